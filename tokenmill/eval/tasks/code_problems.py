"""Code-completion problems written for tokenmill (HumanEval's shape: a signature and docstring to
complete, hidden asserts to pass). Small on purpose: each runs in milliseconds in the sandbox."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CodeProblem:
    name: str
    prompt: str  # the model continues this (a function header and docstring)
    tests: str  # asserts, run after the completed function


def _p(name: str, signature: str, doc: str, tests: str) -> CodeProblem:
    body = "\n    ".join(doc.strip().splitlines())
    return CodeProblem(name, f'def {signature}:\n    """{body}\n    """\n', tests.strip() + "\n")


PROBLEMS: tuple[CodeProblem, ...] = (
    _p("add", "add(a, b)", "Return the sum of a and b.\n>>> add(2, 3)\n5",
       "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 32) == 42"),
    _p("is_even", "is_even(n)", "Return True if n is even, else False.\n>>> is_even(4)\nTrue",
       "assert is_even(4)\nassert not is_even(7)\nassert is_even(0)"),
    _p("max_of_list", "max_of_list(xs)", "Return the largest number in the non-empty list xs.\n"
       ">>> max_of_list([3, 9, 2])\n9",
       "assert max_of_list([3, 9, 2]) == 9\nassert max_of_list([-5, -2]) == -2\nassert max_of_list([7]) == 7"),
    _p("reverse_string", "reverse_string(s)", "Return s reversed.\n>>> reverse_string('abc')\n'cba'",
       "assert reverse_string('abc') == 'cba'\nassert reverse_string('') == ''\nassert reverse_string('ab') == 'ba'"),
    _p("count_vowels", "count_vowels(s)", "Return the number of vowels (a, e, i, o, u; any case) in s.\n"
       ">>> count_vowels('Hello')\n2",
       "assert count_vowels('Hello') == 2\nassert count_vowels('xyz') == 0\nassert count_vowels('AEIOU') == 5"),
    _p("factorial", "factorial(n)", "Return n! for n >= 0.\n>>> factorial(5)\n120",
       "assert factorial(5) == 120\nassert factorial(0) == 1\nassert factorial(1) == 1\n"
       "assert factorial(10) == 3628800"),
    _p("fibonacci", "fibonacci(n)", "Return the n-th Fibonacci number, with fibonacci(0) == 0 and fibonacci(1) == 1.\n"
       ">>> fibonacci(10)\n55",
       "assert fibonacci(0) == 0\nassert fibonacci(1) == 1\nassert fibonacci(10) == 55\nassert fibonacci(20) == 6765"),
    _p("is_palindrome", "is_palindrome(s)", "Return True if the string s reads the same forwards and backwards.\n"
       ">>> is_palindrome('racecar')\nTrue",
       "assert is_palindrome('racecar')\nassert not is_palindrome('abc')\nassert is_palindrome('')"),
    _p("sum_of_squares", "sum_of_squares(xs)", "Return the sum of the squares of the numbers in xs.\n"
       ">>> sum_of_squares([1, 2, 3])\n14",
       "assert sum_of_squares([1, 2, 3]) == 14\nassert sum_of_squares([]) == 0\nassert sum_of_squares([-2]) == 4"),
    _p("count_words", "count_words(text)", "Return the number of whitespace-separated words in text.\n"
       ">>> count_words('the quick brown fox')\n4",
       "assert count_words('the quick brown fox') == 4\nassert count_words('') == 0\n"
       "assert count_words('  a  b ') == 2"),
    _p("unique_sorted", "unique_sorted(xs)", "Return the distinct elements of xs in increasing order.\n"
       ">>> unique_sorted([3, 1, 3, 2])\n[1, 2, 3]",
       "assert unique_sorted([3, 1, 3, 2]) == [1, 2, 3]\nassert unique_sorted([]) == []\n"
       "assert unique_sorted([5, 5]) == [5]"),
    _p("celsius_to_fahrenheit", "celsius_to_fahrenheit(c)", "Convert degrees Celsius to Fahrenheit.\n"
       ">>> celsius_to_fahrenheit(100)\n212.0",
       "assert celsius_to_fahrenheit(100) == 212\nassert celsius_to_fahrenheit(0) == 32\n"
       "assert abs(celsius_to_fahrenheit(-40) + 40) < 1e-9"),
    _p("gcd", "gcd(a, b)", "Return the greatest common divisor of two positive integers.\n>>> gcd(12, 18)\n6",
       "assert gcd(12, 18) == 6\nassert gcd(7, 13) == 1\nassert gcd(100, 10) == 10"),
    _p("is_prime", "is_prime(n)", "Return True if n is a prime number.\n>>> is_prime(7)\nTrue",
       "assert is_prime(7)\nassert not is_prime(1)\nassert not is_prime(9)\nassert is_prime(2)\nassert is_prime(97)"),
    _p("flatten", "flatten(lists)", "Flatten a list of lists into one list, keeping the order.\n"
       ">>> flatten([[1, 2], [3], []])\n[1, 2, 3]",
       "assert flatten([[1, 2], [3], []]) == [1, 2, 3]\nassert flatten([]) == []\n"
       "assert flatten([['a'], ['b']]) == ['a', 'b']"),
    _p("capitalize_words", "capitalize_words(s)", "Return s with the first letter of every word upper-cased.\n"
       ">>> capitalize_words('hello world')\n'Hello World'",
       "assert capitalize_words('hello world') == 'Hello World'\nassert capitalize_words('a') == 'A'"),
    _p("char_frequency", "char_frequency(s)", "Return a dict mapping each character of s to its count.\n"
       ">>> char_frequency('aab')\n{'a': 2, 'b': 1}",
       "assert char_frequency('aab') == {'a': 2, 'b': 1}\nassert char_frequency('') == {}"),
    _p("second_largest", "second_largest(xs)", "Return the second largest distinct value in xs "
       "(xs has at least two distinct values).\n>>> second_largest([4, 1, 4, 3])\n3",
       "assert second_largest([4, 1, 4, 3]) == 3\nassert second_largest([1, 2]) == 1\n"
       "assert second_largest([-1, -5, -3]) == -3"),
    _p("running_sum", "running_sum(xs)", "Return the list of prefix sums of xs.\n"
       ">>> running_sum([1, 2, 3])\n[1, 3, 6]",
       "assert running_sum([1, 2, 3]) == [1, 3, 6]\nassert running_sum([]) == []\nassert running_sum([5]) == [5]"),
    _p("digits_sum", "digits_sum(n)", "Return the sum of the decimal digits of the non-negative integer n.\n"
       ">>> digits_sum(1234)\n10",
       "assert digits_sum(1234) == 10\nassert digits_sum(0) == 0\nassert digits_sum(9) == 9"),
    _p("remove_duplicates", "remove_duplicates(xs)", "Return xs without repeated elements, keeping first "
       "occurrences in order.\n>>> remove_duplicates([1, 2, 1, 3, 2])\n[1, 2, 3]",
       "assert remove_duplicates([1, 2, 1, 3, 2]) == [1, 2, 3]\nassert remove_duplicates([]) == []"),
    _p("average", "average(xs)", "Return the arithmetic mean of the non-empty list xs.\n"
       ">>> average([1, 2, 3, 4])\n2.5",
       "assert average([1, 2, 3, 4]) == 2.5\nassert average([5]) == 5"),
    _p("count_positive", "count_positive(xs)", "Return how many numbers in xs are greater than zero.\n"
       ">>> count_positive([-1, 0, 2, 3])\n2",
       "assert count_positive([-1, 0, 2, 3]) == 2\nassert count_positive([]) == 0"),
    _p("clamp", "clamp(x, low, high)", "Return x limited to the range [low, high].\n>>> clamp(15, 0, 10)\n10",
       "assert clamp(15, 0, 10) == 10\nassert clamp(-3, 0, 10) == 0\nassert clamp(5, 0, 10) == 5"),
)
