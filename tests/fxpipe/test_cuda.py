"""fxpipe on a GPU: the split, one-rank training over NCCL (every schedule, resume), and autocast, against plain torch.

Skipped without CUDA (CI has no GPU). One GPU is enough: NCCL between two
ranks needs two GPUs, so what crosses stages on CUDA is checked in one
process (``run_local``), and training runs on one rank.

Tolerances: the split runs the same kernels as the model, so outputs and
gradients agree to 1e-6 (float32). One-rank training in float64 against a
single-process reference: 1e-9 of each weight's change, as the CPU tests.
Autocast: the first step's gradient against ``torch.autocast`` on the
unsplit model, 1e-3 relative, and clearly away from the fp32 gradient.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
import torch.nn.functional as F

import fxpipe
from fxpipe.runtime.devices import DeviceError
from tests.fxpipe.runtime import cases
from tests.fxpipe.runtime.test_train_api import assert_close_to_reference, data_list, make_net, mse
from tests.models import PosNet, TinyGPT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = Path(__file__).resolve().parents[2]
VOCAB, CTX = 64, 16


def _gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, dim=32, heads=2, layers=4, ctx=CTX)


def _tokens(n: int, micro: int = 4) -> List[Any]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        idx = torch.randint(0, VOCAB, (micro, CTX + 1), generator=g)
        out.append(((idx[:, :-1],), idx[:, 1:]))
    return out


def _xent(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


@pytest.fixture
def no_tf32():
    """Full fp32 matmuls for the test, then the setting as it was (TF32 rounds to 10 mantissa bits)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def test_split_runs_on_cuda_like_the_model(no_tf32) -> None:
    """Three stages in one process on the GPU: outputs and every gradient as the unsplit model's."""
    model = _gpt().cuda()
    (x,), y = _tokens(1)[0]
    x, y = x.cuda(), y.cuda()
    # without replicas: the CUDA profile decides the plan, and on an H100 the optimum had 2 stages, one replicated
    sm = fxpipe.split(model, (x,), 3, progress=False, device="cuda", time_limit=5, replication="none")
    assert sm.num_stages == 3
    assert all(p.is_cuda for st in sm.stages for p in st.parameters())
    want = model(x)
    _xent(want, y).backward()
    want_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    got = fxpipe.run_local(sm, x)
    _xent(got, y).backward()
    assert got.is_cuda
    assert (got - want).abs().max().item() <= 1e-6 * want.abs().max().item()
    for k, p in model.named_parameters():  # the stages hold the model's own parameters
        assert (p.grad - want_grads[k]).norm().item() <= 1e-6 * want_grads[k].norm().item(), k


def test_profiling_on_cuda_leaves_a_cpu_model_on_the_cpu() -> None:
    """``device="cuda"`` measures there; the model, its split and its inputs stay where they were."""
    model = _gpt()
    (x,), y = _tokens(1)[0]
    sm = fxpipe.split(model, (x,), 2, progress=False, device="cuda", time_limit=5)
    assert sm.profile.info["device"].startswith("cuda")
    assert not any(p.is_cuda for p in model.parameters()) and not any(b.is_cuda for b in model.buffers())
    want = model(x)
    assert torch.equal(fxpipe.run_local(sm, x), want)


def test_one_rank_trains_on_cuda_like_one_process() -> None:
    """``fxpipe.train(..., device="cuda")``: NCCL, one GPU; float64 weights equal the reference after 3 steps."""
    steps, M, lr = 3, 2, 0.01
    model = make_net()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = fxpipe.train(model, data_list(steps * M), loss_fn=mse, devices=1, device="cuda", microbatches=M,
                       steps=steps, lr=lr, optimizer="adamw", time_limit=3, timeout=120)
    want = cases.accumulate_model(make_net(), data_list(steps * M).__getitem__, mse, steps, M, "adamw", lr)
    assert_close_to_reference(out.state_dict, want, start)


def _posnet() -> PosNet:
    torch.manual_seed(3)
    return PosNet().double()


def test_export_graph_profiles_and_trains_on_cuda() -> None:
    """An export graph names its capture device (CPU) in constants: profiling on CUDA and one-rank
    training there move them with the parameters (they failed at the first kernel: HF GPT-2 did)."""
    model = _posnet()
    (x,), _ = data_list(1)[0]
    sm = fxpipe.split(model, (x,), 2, progress=False, device="cuda", capture_method="export", time_limit=5,
                      replication="none")
    assert sm.profile.info["device"].startswith("cuda") and sm.num_stages == 2
    torch.testing.assert_close(fxpipe.run_local(sm, x), model(x), rtol=0, atol=0)  # back on the CPU
    steps, M, lr = 3, 2, 0.01
    start = {k: v.detach().clone() for k, v in _posnet().state_dict().items()}
    out = fxpipe.train(_posnet(), data_list(steps * M), loss_fn=mse, devices=1, device="cuda", microbatches=M,
                       steps=steps, lr=lr, optimizer="adamw", capture_method="export", time_limit=3, timeout=120)
    want = cases.accumulate_model(_posnet(), data_list(steps * M).__getitem__, mse, steps, M, "adamw", lr)
    assert_close_to_reference(out.state_dict, want, start)


def _first_step_gradient(precision: str) -> Dict[str, torch.Tensor]:
    """The gradient one-rank fxpipe training used in its first SGD step, read off the weight change."""
    lr, M = 0.5, 2
    model = _gpt()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = fxpipe.train(model, _tokens(M), loss_fn=_xent, devices=1, device="cuda", microbatches=M, steps=1,
                       lr=lr, precision=precision, schedule="1f1b-flush", time_limit=3, timeout=120)
    return {k: (start[k] - out.state_dict[k]) / lr for k, _ in _gpt().named_parameters()}


def _reference_gradient(precision: str) -> Dict[str, torch.Tensor]:
    """Unsplit model on the GPU under ``torch.autocast``: gradient of the mean microbatch loss.

    fp16 scales the loss by 2**16 and the gradient back, as ``torch.amp.GradScaler``'s first step (and
    fxpipe's ``LossScaler``) does: unscaled, small fp16 gradients would round differently.
    """
    model, M = _gpt().cuda(), 2
    scale = 2.0 ** 16 if precision == "fp16" else 1.0
    for (x,), y in _tokens(M):
        with torch.autocast("cuda", dtype=torch.bfloat16 if precision == "bf16" else torch.float16,
                            enabled=precision != "fp32"):
            loss = _xent(model(x.cuda()), y.cuda()) / M
        (loss * scale).backward()
    return {k: p.grad.cpu() / scale for k, p in model.named_parameters()}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_on_cuda_matches_torch_autocast(precision: str) -> None:
    got = _first_step_gradient(precision)
    low, fp32 = _reference_gradient(precision), _reference_gradient("fp32")

    def worst(ref: Dict[str, torch.Tensor]) -> float:
        return max(((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)).item() for k in ref)

    assert worst(low) <= 1e-3, worst(low)
    assert worst(fp32) > 3 * worst(low), (worst(fp32), worst(low))  # autocast really ran in low precision


def test_cuda_with_more_workers_than_gpus_is_refused_before_workers_start() -> None:
    n = torch.cuda.device_count() + 1
    with pytest.raises(DeviceError, match=f"{n} workers were asked for"):
        fxpipe.train(make_net(), data_list(n), loss_fn=mse, devices=n, device="cuda", steps=1, time_limit=3)


@pytest.mark.skipif(torch.cuda.device_count() != 1, reason="for a one-GPU machine")
def test_auto_with_more_workers_than_gpus_trains_on_cpu(capfd) -> None:
    steps, M, lr = 2, 2, 0.01
    model = make_net()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = fxpipe.train(model, data_list(steps * M), loss_fn=mse, devices=2, microbatches=M, steps=steps, lr=lr,
                       optimizer="adamw", replication="none", time_limit=3, threads=1, timeout=120)
    assert "2 workers on CPU (gloo)" in capfd.readouterr().err
    want = cases.accumulate_model(make_net(), data_list(steps * M).__getitem__, mse, steps, M, "adamw", lr)
    assert_close_to_reference(out.state_dict, want, start)


def test_cli_trains_the_example_on_one_gpu(tmp_path: Path) -> None:
    """``fxpipe train examples/gpt.py --devices 1 --device cuda``: profiled on CUDA, loss falls."""
    out = subprocess.run([sys.executable, "-m", "fxpipe", "train", str(ROOT / "examples" / "gpt.py"), "--devices",
                          "1", "--device", "cuda", "--steps", "20", "--optimizer", "adamw", "--time-limit", "5"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "1 worker on CUDA (NCCL" in out.stderr
    losses = [float(line.split("loss ")[1].split()[0]) for line in out.stdout.splitlines() if " loss " in line]
    assert len(losses) == 20 and losses[-1] < losses[0] - 0.5, losses


def _schedule_run(schedule: str, device: str) -> None:
    """One rank, float64, AdamW: the weights after 3 steps against the schedule's reference.

    On one stage ``1f1b-stash`` is an update after every microbatch (a step is M minibatches of one),
    ``2bw`` is W(t+1) = W(t) - lr * grad f(W(t-1)), and the flushing schedules are accumulation.
    """
    steps, M, lr = 3, 2, 0.05
    model = make_net()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = fxpipe.train(model, data_list(steps * M), loss_fn=mse, devices=1, device=device, microbatches=M,
                       steps=steps, lr=lr, optimizer="adamw", schedule=schedule, time_limit=3, timeout=120)
    data = data_list(steps * M).__getitem__
    if schedule == "2bw":
        want = cases.two_bw_model(make_net(), data, mse, steps, M, "adamw", lr)
    elif schedule == "1f1b-stash":
        want = cases.accumulate_model(make_net(), data, mse, steps * M, 1, "adamw", lr)
    else:
        want = cases.accumulate_model(make_net(), data, mse, steps, M, "adamw", lr)
    assert_close_to_reference(out.state_dict, want, start)


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1", "1f1b-stash", "2bw"])
def test_every_schedule_trains_on_one_gpu_like_its_reference(schedule: str) -> None:
    _schedule_run(schedule, "cuda")


def _resume_run(tmp_path: Path, device: str) -> None:
    """Stop after 2 of 4 steps, resume from the checkpoint: the weights equal an uninterrupted run's."""
    M, lr = 2, 0.01

    def run(steps: int, where: str, resume: bool = False) -> Dict[str, torch.Tensor]:
        return fxpipe.train(make_net(), data_list(4 * M), loss_fn=mse, devices=1, device=device, microbatches=M,
                            steps=steps, lr=lr, optimizer="adamw", schedule="1f1b-stash",
                            checkpoint=str(tmp_path / where), checkpoint_every=2, resume=resume, time_limit=3,
                            timeout=120).state_dict

    whole = run(4, "a")
    run(2, "b")
    resumed = run(4, "b", resume=True)
    start = make_net().state_dict()
    for k in whole:
        torch.testing.assert_close(resumed[k], whole[k], rtol=1e-12, atol=1e-12)
    assert any(not torch.equal(whole[k], start[k]) for k in whole)  # it trained


def test_resume_on_cuda_continues_like_an_uninterrupted_run(tmp_path: Path) -> None:
    _resume_run(tmp_path, "cuda")
