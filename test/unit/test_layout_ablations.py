"""The bench-only ablations of the canary's install (``benchmarks/stack_sampler``: ``device_bytes.py``,
``layout_ablations.py``, ``dummy_kernel.py``), which ``profile_decode.py`` and the benches set through a server's
``KVC_DIAG_*`` environment: each applied in a fresh interpreter as a server would, bad values refused naming the
variable (no server, no GPU)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from script_loader import _load  # test/unit: on the path under pytest

overhead_plan = _load("overhead_plan")
# the probes import sglang in a fresh interpreter: the GPU host's unit step may run before sglang is installed
needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                  reason="needs sglang installed (its probe imports sglang in a fresh interpreter)")
# dummy_kernel's store runs compiled on a GPU host, in the interpreter on CPU
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _off_server_env(*pairs):
    """(an off server's environment with the ``KVC_DIAG_*`` ``pairs``, the test's own environment without the
    sampler's variables): a fresh interpreter started with both applies the ablations as a server would."""
    import os

    plan = {"env": {"SGLANG_EXTERNAL_MODEL_PACKAGE": ""}, "storm_warmup_forwards": 256}
    off = overhead_plan.CONFIGS["off"]
    env = overhead_plan.server_env(type(off)(**{**off.__dict__, "env": tuple(pairs)}), plan, None, {})
    assert env["PYTHONPATH"].split(":")[0] == str(overhead_plan.SAMPLER_DIR)
    return env, {k: v for k, v in os.environ.items() if k not in ("KVC_STACK_SAMPLE_DIR", "PYTHONPATH")}


@needs_sglang
def test_the_layout_probe_holds_its_bytes_after_the_kv_pool_of_a_server_without_the_canary():
    """KVC_DIAG_DEVICE_BYTES=N (stack_sampler/device_bytes.py): the installed sglang's KV pool builder
    (ModelRunner.alloc_memory_pool, or init_memory_pool on 0.5.12) is wrapped once its module is imported in a fresh
    interpreter with the probe's environment; the wrapper returns what it returned and then holds N device bytes; a
    bad N is refused naming the variable."""
    import subprocess
    import sys

    env, base = _off_server_env((overhead_plan.DEVICE_BYTES_ENV, "4096"))
    probe = ("from sglang.srt.model_executor.model_runner import ModelRunner as M\n"
             "pool = getattr(M, 'alloc_memory_pool', None) or M.init_memory_pool\n"
             "print(pool.__code__.co_filename.endswith('device_bytes.py'))\n")
    got = subprocess.run([sys.executable, "-c", probe], env={**base, **env}, capture_output=True, text=True,
                         timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.split()[-1] == "True"
    bad = subprocess.run([sys.executable, "-c", "pass"], env={**base, **env, overhead_plan.DEVICE_BYTES_ENV: "6MB"},
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "KVC_DIAG_DEVICE_BYTES='6MB'" in bad.stderr

    sys.path.insert(0, str(overhead_plan.SAMPLER_DIR))
    try:
        import device_bytes
    finally:
        sys.path.remove(str(overhead_plan.SAMPLER_DIR))

    class Runner:
        device, gpu_id = "cpu", 0

        def init_memory_pool(self, total):
            return f"pool of {total}"

    device_bytes.wrap(Runner, 4096)
    runner = Runner()
    assert runner.init_memory_pool(7) == "pool of 7"
    with pytest.raises(AttributeError, match="KVC_DIAG_DEVICE_BYTES"):
        device_bytes.wrap(type("NoPool", (), {}), 1)
    held = runner.kvc_diag_device_bytes
    assert held.numel() == 4096 and held.device.type == "cpu"


@needs_sglang
def test_the_install_ablations_shrink_the_pool_budget_or_skip_the_precompile_in_a_fresh_interpreter():
    """KVC_DIAG_RESERVE_BYTES=N (stack_sampler/layout_ablations.py): 0.5.12's ``_profile_available_bytes`` returns N
    fewer bytes; KVC_DIAG_SKIP_PRECOMPILE=1 replaces the install's ``_precompile`` (so do KVC_DIAG_PRECOMPILE_POOL and
    _EMPTY_CACHE, wrapping it); the skip is refused without the idle
    canary (a working canary would compile while serving); a bad N is refused naming the variable."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("sglang.srt.model_executor.model_runner_kv_cache_mixin") is None:
        pytest.skip("the reserve ablation wraps sglang 0.5.12's ModelRunnerKVCacheMixin, absent from this line")
    env, base = _off_server_env(("KVC_DIAG_RESERVE_BYTES", "4096"))
    probe = ("from sglang.srt.model_executor.model_runner_kv_cache_mixin import ModelRunnerKVCacheMixin as M\n"
             "print(M._profile_available_bytes.__code__.co_filename.endswith('layout_ablations.py'))\n"
             "import kv_canary.adapter.install as i\n"
             "print(i._precompile.__code__.co_filename.endswith('layout_ablations.py'))\n")
    got = subprocess.run([sys.executable, "-c", probe], env={**base, **env}, capture_output=True, text=True,
                         timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.split()[-2:] == ["True", "False"]
    skip = {**base, **env, "KVC_DIAG_SKIP_PRECOMPILE": "1", "KVC_DIAG_CANARY_IDLE": "1"}
    got = subprocess.run([sys.executable, "-c", probe], env=skip, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.split()[-2:] == ["True", "True"]
    apart = {**base, **env, "KVC_DIAG_PRECOMPILE_POOL": "1", "KVC_DIAG_PRECOMPILE_EMPTY_CACHE": "1"}
    got = subprocess.run([sys.executable, "-c", probe], env=apart, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.split()[-2:] == ["True", "True"]
    refused = subprocess.run([sys.executable, "-c", "pass"], env={**skip, "KVC_DIAG_CANARY_IDLE": "0"},
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "needs KVC_DIAG_CANARY_IDLE=1" in refused.stderr
    bad = subprocess.run([sys.executable, "-c", "pass"], env={**base, **env, "KVC_DIAG_RESERVE_BYTES": "32MB"},
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "KVC_DIAG_RESERVE_BYTES='32MB'" in bad.stderr


def test_the_launch_ablations_keep_the_precompile_off_the_device_only_while_it_runs():
    """KVC_DIAG_PRECOMPILE_LAUNCH (layout_ablations.py): while the wrapped precompile runs, Triton's CUDA launcher
    does nothing (``load``: modules still load; ``compile``: no module loads either; ``load`` with
    KVC_DIAG_PRECOMPILE_LOAD_ONLY: only the named kernels' modules); afterwards Triton's own methods are back."""
    import sys
    import types

    pytest.importorskip("triton.backends.nvidia.driver")
    from triton.backends.nvidia.driver import CudaLauncher
    from triton.compiler.compiler import CompiledKernel

    sys.path.insert(0, str(overhead_plan.SAMPLER_DIR))
    try:
        import layout_ablations
    finally:
        sys.path.remove(str(overhead_plan.SAMPLER_DIR))
    before = (CudaLauncher.__call__, CompiledKernel._init_handles, CompiledKernel.__dict__["run"])
    seen = []

    def precompile(*args):
        seen.append((args, CudaLauncher.__call__(None, 1, 1, 1, None, None), CompiledKernel._init_handles is before[1],
                     CompiledKernel.__dict__["run"] is before[2]))

    for load, kept in ((True, True), (False, False)):
        install = types.SimpleNamespace(_precompile=precompile)
        layout_ablations._precompile_without_launches(install, load)
        install._precompile("manager")
        assert seen.pop() == (("manager",), None, kept, kept)
        assert (CudaLauncher.__call__, CompiledKernel._init_handles, CompiledKernel.__dict__["run"]) == before

    handled = []
    real_init = CompiledKernel.__dict__["_init_handles"]

    def selective(*_args):
        for name in ("write_kernel", "verify_kernel"):
            kernel = object.__new__(CompiledKernel)
            kernel.name = name
            CompiledKernel._init_handles(kernel)
            handled.append((name, kernel.run is layout_ablations._no_launch))

    CompiledKernel._init_handles = lambda kernel: setattr(kernel, "_run", "loaded") or handled.append(kernel.name)
    CompiledKernel.run = property(lambda kernel: kernel._init_handles() or kernel._run)
    try:
        install = types.SimpleNamespace(_precompile=selective)
        layout_ablations._precompile_without_launches(install, True, frozenset({"write_kernel"}))
        install._precompile()
    finally:
        CompiledKernel._init_handles, CompiledKernel.run = real_init, before[2]
    # write_kernel loads (its handles initialized, twice: once by name, once by its run), verify_kernel never does
    assert handled == ["write_kernel", "write_kernel", ("write_kernel", False), ("verify_kernel", True)]
    assert (CudaLauncher.__call__, CompiledKernel._init_handles, CompiledKernel.__dict__["run"]) == before
    install = types.SimpleNamespace(_precompile=selective)  # a name no precompiled kernel has: refused, naming both
    layout_ablations._precompile_without_launches(install, True, frozenset({"write_kernal"}))
    with pytest.raises(SystemExit, match="no variant of write_kernal was precompiled .*verify_kernel,write_kernel"):
        install._precompile()
    assert (CudaLauncher.__call__, CompiledKernel._init_handles, CompiledKernel.__dict__["run"]) == before


def test_the_dummy_modules_ablation_launches_k_variants_after_the_kv_pool(monkeypatch):
    """KVC_DIAG_DUMMY_MODULES=K (layout_ablations.py): the KV pool builder returns what it returned, then K variants
    of dummy_kernel's store (each its own module on a GPU) have run on the runner's device; a bad K is refused."""
    import os
    import subprocess
    import sys
    import types

    monkeypatch.syspath_prepend(str(overhead_plan.SAMPLER_DIR))
    import dummy_kernel
    import layout_ablations

    launched = []
    real = dummy_kernel.load_modules
    monkeypatch.setattr(dummy_kernel, "load_modules", lambda device, count, unroll: launched.append(
        (device.type, count, unroll)) or real(device, count, unroll))

    class ModelRunner:
        device, gpu_id = DEVICE, 0

        def init_memory_pool(self, total):
            return f"pool of {total}"

    layout_ablations._dummy_modules_after_pool(types.SimpleNamespace(ModelRunner=ModelRunner), 3, 5)
    assert ModelRunner().init_memory_pool(7) == "pool of 7"
    assert launched == [(DEVICE, 3, 5)]
    out = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    dummy_kernel.dummy_store[(1,)](out, TAG=7, UNROLL=4)  # the unrolled stores: TAG + i at word i
    assert out.tolist() == [7, 8, 9, 10]
    bad = subprocess.run([sys.executable, "-c", "pass"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(overhead_plan.SAMPLER_DIR),
                              "KVC_DIAG_DUMMY_MODULES": "0"})
    assert bad.returncode != 0 and "KVC_DIAG_DUMMY_MODULES='0'" in bad.stderr
    lone = subprocess.run([sys.executable, "-c", "pass"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(overhead_plan.SAMPLER_DIR), "KVC_DIAG_DUMMY_UNROLL": "4"})
    assert lone.returncode != 0 and "only with KVC_DIAG_DUMMY_MODULES" in lone.stderr
    only = subprocess.run([sys.executable, "-c", "pass"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(overhead_plan.SAMPLER_DIR),
                               "KVC_DIAG_PRECOMPILE_LOAD_ONLY": "write_kernel"})
    assert only.returncode != 0 and "with KVC_DIAG_PRECOMPILE_LAUNCH=load" in only.stderr
