"""Which formats `auto` packs GGUF Q5_0 and Q6_K into: q5 and q6 only where measured faster
(gguf_quant.q5_0_format, q6_k_format)."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType

from tokenmill.errors import TokenmillError
from tokenmill.kernels import cpu_vendor_family
from tokenmill.layers import gguf_quant as gq

ZEN5 = ("AuthenticAMD", 26)
ZEN4 = ("AuthenticAMD", 25)
XEON = ("GenuineIntel", 6)


@pytest.mark.parametrize(("isa", "cpu", "fmt"), [
    ("avx512vnni", ZEN5, "q5"),  # measured 1.06-1.13x of q8 over batch 1-16
    ("avx2", ZEN5, "q8"),  # a forced narrower path keeps the AVX2 decision
    ("avx512vnni", ZEN4, "q8"),  # 0.92x at batch 1
    ("avx2", ("AuthenticAMD", 25), "q8"),  # Zen 3: 0.78x at batch 16
    ("avx512vnni", XEON, "q8"),  # unmeasured
    ("amx", XEON, "q8"),
    ("portable", ZEN5, "q8"),
])
def test_q5_only_where_it_was_measured_faster(isa: str, cpu: tuple[str, int], fmt: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gq.Q5_0_ENV, raising=False)
    assert gq.q5_0_format(isa, *cpu) == fmt


def test_the_environment_overrides_and_a_bad_value_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gq.Q5_0_ENV, "Q5")
    assert gq.q5_0_format("avx2", *XEON) == "q5"
    monkeypatch.setenv(gq.Q5_0_ENV, "q8")
    assert gq.q5_0_format("avx512vnni", *ZEN5) == "q8"
    assert gq.gguf_format(GGMLQuantizationType.Q5_0, "avx512vnni") == ("q8", True)
    monkeypatch.setenv(gq.Q5_0_ENV, "q5")
    assert gq.gguf_format(GGMLQuantizationType.Q5_0, "portable") == ("q5", True)
    assert gq.gguf_format(GGMLQuantizationType.Q4_K, "portable") == ("q4", True)  # only Q5_0 moves
    monkeypatch.setenv(gq.Q5_0_ENV, "q6")
    with pytest.raises(TokenmillError, match="TOKENMILL_Q5_0"):
        gq.q5_0_format("avx2", *ZEN5)


def test_vendor_and_family_come_from_the_first_processor() -> None:
    cpuinfo = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n\n"
               "processor\t: 1\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n")
    assert cpu_vendor_family(cpuinfo) == ("AuthenticAMD", 26)
    assert cpu_vendor_family("Features\t: fp asimd\n") == ("", 0)  # Arm: no x86 family
    assert cpu_vendor_family("") == ("", 0)


@pytest.mark.parametrize(("isa", "cpu", "fmt"), [
    ("avx512vnni", ZEN5, "q6"),  # measured 1.05-1.15x of q8 at batch 1, 1.07x at 16, 0.98x on a prefill
    ("avx2", ZEN5, "q8"),  # the 256-bit tiles through AVX2: 0.915x at batch 1 (0.75x before kByteBits)
    ("avx512vnni", ZEN4, "q8"),  # no duo tiles there: unmeasured
    ("avx512vnni", XEON, "q8"),
    ("amx", XEON, "q8"),  # the AMX tiles take no q6
    ("portable", ZEN5, "q8"),
])
def test_q6_only_where_it_was_measured_faster(isa: str, cpu: tuple[str, int], fmt: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gq.Q6_K_ENV, raising=False)
    assert gq.q6_k_format(isa, *cpu) == fmt


def test_q6_k_maps_exactly_only_as_q6(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gq.Q6_K_ENV, "q6")
    assert gq.gguf_format(GGMLQuantizationType.Q6_K, "portable") == ("q6", True)
    monkeypatch.setenv(gq.Q6_K_ENV, "Q8")
    assert gq.gguf_format(GGMLQuantizationType.Q6_K, "avx512vnni") == ("q8", False)  # a re-rounding
    monkeypatch.setenv(gq.Q6_K_ENV, "q5")
    with pytest.raises(TokenmillError, match="TOKENMILL_Q6_K"):
        gq.q6_k_format("avx2", *ZEN5)


def test_q5_1_and_q5_k_stay_5_bit_unless_the_environment_says_q8(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gq.Q5_K_ENV, raising=False)
    for ggml_type in (GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q5_K):
        assert gq.gguf_format(ggml_type, "avx2") == ("q5", True)  # every host: exact, 0.6x q8's bytes
    monkeypatch.setenv(gq.Q5_K_ENV, "q8")
    assert gq.gguf_format(GGMLQuantizationType.Q5_K, "avx512vnni") == ("q8", False)  # a re-rounding
    monkeypatch.setenv(gq.Q5_K_ENV, "q4")
    with pytest.raises(TokenmillError, match="TOKENMILL_Q5_K"):
        gq.gguf_format(GGMLQuantizationType.Q5_1, "avx2")
