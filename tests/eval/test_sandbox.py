"""The code task's sandbox: loops die at the timeout, writes outside its folder are refused, and the
shipped problems are well posed (a reference solution passes every one, a wrong one fails)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tokenmill.eval.sandbox import SandboxLimits, run_python
from tokenmill.eval.tasks.code import program
from tokenmill.eval.tasks.code_problems import PROBLEMS

FAST = SandboxLimits(timeout_s=1.5)

REFERENCE = {
    "add": "return a + b", "is_even": "return n % 2 == 0", "max_of_list": "return max(xs)",
    "reverse_string": "return s[::-1]", "count_vowels": "return sum(c in 'aeiouAEIOU' for c in s)",
    "factorial": "import math\n    return math.factorial(n)",
    "fibonacci": "a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    "is_palindrome": "return s == s[::-1]", "sum_of_squares": "return sum(x * x for x in xs)",
    "count_words": "return len(text.split())", "unique_sorted": "return sorted(set(xs))",
    "celsius_to_fahrenheit": "return c * 9 / 5 + 32", "gcd": "import math\n    return math.gcd(a, b)",
    "is_prime": "return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))",
    "flatten": "return [x for part in lists for x in part]",
    "capitalize_words": "return ' '.join(w[:1].upper() + w[1:] for w in s.split(' '))",
    "char_frequency": "d = {}\n    for c in s:\n        d[c] = d.get(c, 0) + 1\n    return d",
    "second_largest": "return sorted(set(xs))[-2]",
    "running_sum": "import itertools\n    return list(itertools.accumulate(xs))",
    "digits_sum": "return sum(map(int, str(n)))", "remove_duplicates": "return list(dict.fromkeys(xs))",
    "average": "return sum(xs) / len(xs)", "count_positive": "return sum(x > 0 for x in xs)",
    "clamp": "return max(low, min(high, x))",
}


@pytest.mark.parametrize("source", ["while True:\n    pass\n", "import time\nwhile True:\n    time.sleep(0.1)\n"],
                         ids=["busy", "sleeping"])
def test_a_program_that_loops_forever_is_killed_at_the_timeout(source: str) -> None:
    start = time.monotonic()
    result = run_python(source, FAST)
    assert result.timed_out and not result.passed
    assert time.monotonic() - start < FAST.timeout_s + 3.0


def test_writes_outside_the_temporary_folder_are_refused(tmp_path: Path) -> None:
    target = tmp_path / "escaped.txt"
    for source in (f"open({str(target)!r}, 'w').write('x')",
                   f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')",
                   f"import os\nos.close(os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT))",
                   f"import shutil\nshutil.copyfile(__file__, {str(target)!r})"):
        result = run_python(source, FAST)
        assert not result.passed and "sandbox" in result.stderr, source
        assert not target.exists(), source
    assert not run_python(f"import os\nos.remove({str(tmp_path)!r})", FAST).passed
    assert tmp_path.is_dir()


def test_processes_and_sockets_are_refused_and_inside_writes_work() -> None:
    assert "subprocess.Popen is refused" in run_python("import subprocess\nsubprocess.run(['true'])", FAST).stderr
    assert "os.system is refused" in run_python("import os\nos.system('true')", FAST).stderr
    assert "socket.connect is refused" in run_python(
        "import socket\nsocket.create_connection(('127.0.0.1', 9))", FAST).stderr
    inside = run_python("open('mine.txt', 'w').write('ok')\nprint(open('mine.txt').read())", FAST)
    assert inside.passed and inside.stdout == "ok\n"
    assert not run_python("raise SystemExit(3)", FAST).passed


def test_every_problem_is_solvable_and_checks_something() -> None:
    assert {p.name for p in PROBLEMS} == set(REFERENCE)
    for problem in PROBLEMS:
        assert run_python(program(problem, "    " + REFERENCE[problem.name] + "\n"), FAST).passed, problem.name
        assert not run_python(program(problem, "    return None\n"), FAST).passed, problem.name
