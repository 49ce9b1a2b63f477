"""`python -m dsv4ops`: a small run of the demo (compiled with aot_eager, FP8 paged cache or the FP4
option, chunked prefill and decode) whose every request stays within its fp64-oracle budget, and its
scheduler."""

import re

import pytest
import torch

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


def test_demo_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--requests", "0"])
    # Issue 32: --device cpu:1 ended in a traceback (the layers land on cpu, the cache on cpu:1).
    for device, match in (("cpu:1", r"expected cpu \(the CPU has no device index\), got 'cpu:1'"),
                          ("gpu", r"expected cpu, cuda or cuda:N, got 'gpu'"),
                          ("meta", r"expected cpu, cuda or cuda:N, got 'meta'"),
                          (f"cuda:{torch.cuda.device_count()}",
                           rf"expected one of this machine's {torch.cuda.device_count()} CUDA devices, got 'cuda:")):
        with pytest.raises(SystemExit) as exit_:
            demo.main(["--device", device])
        assert exit_.value.code == 2
        assert re.search(rf"python -m dsv4ops: error: argument --device: {match}", capsys.readouterr().err)
    with pytest.raises(SystemExit, match=r"--layers: the tiny preset has 4 layers, got 9"):
        demo.main(["--layers", "9"])


def test_demo_runs_on_one_cpu_thread_and_restores_the_callers(monkeypatch):
    """On a CPU the demo's ops run on one thread unless --threads says otherwise (threads that
    spin-wait for each other on a loaded machine made decode steps ~30x slower), and the caller's
    thread count comes back afterwards, also when the run raises."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the caller's count (distinct from the demo's default)
    try:
        monkeypatch.setattr(demo, "run", lambda args: torch.get_num_threads())
        assert demo.main(["--device", "cpu"]) == 1
        assert torch.get_num_threads() == 2
        assert demo.main(["--device", "cpu", "--threads", "3"]) == 3
        assert torch.get_num_threads() == 2

        def fails(args):
            raise RuntimeError("the run failed")

        monkeypatch.setattr(demo, "run", fails)
        with pytest.raises(RuntimeError, match="the run failed"):
            demo.main(["--device", "cpu"])
        assert torch.get_num_threads() == 2
        with pytest.raises(SystemExit):
            demo.main(["--threads", "0"])
    finally:
        torch.set_num_threads(before)
