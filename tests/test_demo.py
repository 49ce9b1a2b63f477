"""`python -m dsv4ops`: a small run of the demo (compiled with aot_eager, FP8 paged cache or the FP4
option, chunked prefill and decode) whose every request stays within its fp64-oracle budget, and its
scheduler."""

import re

import pytest

from dsv4ops.bench import demo


def test_schedule_is_continuous_batching():
    lengths, prompts = [40, 30, 9], [30, 25, 1]
    steps = demo.schedule(lengths, prompts, budget=16)
    got = [0, 0, 0]
    for step in steps:
        assert sum(step.values()) <= 16
        for r, n in step.items():
            if got[r] >= prompts[r]:
                assert n == 1  # past its prompt: one token per step
            else:
                assert got[r] + n <= prompts[r]  # a prefill chunk never runs past the prompt
            got[r] += n
    assert got == lengths
    # A request past its prompt decodes in every step until it is done.
    first_decode = [next(i for i, s in enumerate(steps) if r in s and sum(
        st.get(r, 0) for st in steps[:i]) >= prompts[r]) for r in range(3)]
    for r, i in enumerate(first_decode):
        assert all(r in s for s in steps[i:i + lengths[r] - prompts[r]])


@pytest.mark.parametrize("cache, rows", [("fp8", "fp8_584/fp8_132"), ("fp4", "fp8_584/fp4_288/mxfp4_68")])
def test_demo_small_run(cache, rows, capsys):
    out = demo.main(["--requests", "2", "--context", "140", "--step-tokens", "64", "--layers", "3", "--kv-cache", cache])
    text = capsys.readouterr().out
    assert "backend: reference kernels (pure PyTorch" in text
    assert "3 layers (sliding, CSA, HCA)" in text and "tokens/s" in text and "MiB of pools" in text
    assert f"({rows} rows)" in text and text.count("vs unquantized: rms") == 2 and "vs V4 reference: rms" in text
    assert re.search(r"step (\d+)/\1 ", text)  # the progress display reached the last step
    assert [r["tokens"] for r in out["results"]] == [140, 105]
    for r in out["results"]:
        assert r["beyond"] == 0 and r["err"] <= r["bound"], r
    assert text.count("within budget") == 2


def test_demo_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        demo.main(["--requests", "0"])
    with pytest.raises(SystemExit, match=r"--layers: the tiny preset has 4 layers, got 9"):
        demo.main(["--layers", "9"])
