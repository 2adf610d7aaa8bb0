"""Bench-only ablations of the canary's install, one step at a time, to bisect its presence effect at decode bs1
(issue 60; ``profile_decode.py --configs``). Each verifies nothing: a bench configuration, never a setting.

- ``KVC_DIAG_RESERVE_BYTES=N`` (a server without the canary): sglang sizes its KV pool from N fewer available
  bytes, as the canary's reserve does (``kv_canary_reserved_bytes``), and nothing else changes.
- ``KVC_DIAG_SKIP_PRECOMPILE=1`` (only with ``KVC_DIAG_CANARY_IDLE=1``, where no canary kernel ever launches): the
  install skips its kernels' precompile (``adapter/install._precompile``): no Triton module is loaded and the
  precompile's launches never use the caching allocator.
- ``KVC_DIAG_PRECOMPILE_POOL=1``: the precompile runs in a private pool of the caching allocator
  (``torch.cuda.MemPool``), so the temporaries its launches free never serve sglang's later allocations.
- ``KVC_DIAG_PRECOMPILE_EMPTY_CACHE=1``: after the precompile, ``torch.cuda.empty_cache()`` (the cached blocks it
  freed go back to the driver).
- ``KVC_DIAG_PRECOMPILE_LAUNCH=load`` / ``=compile`` (only with the idle canary): during the precompile Triton's
  launches do not reach the device: ``load`` loads each variant's module (``CompiledKernel._init_handles``) and skips
  the launch (``CudaLauncher.__call__``); ``compile`` compiles only (no module is loaded). With lease G/H's finding
  (the precompile moves the GEMM; its allocations do not), they tell whether loading the canary's modules is the cause
  (lease I: ``load`` moves it, ``compile`` does not).
- ``KVC_DIAG_PRECOMPILE_LOAD_ONLY=NAME[+NAME...]`` (with ``KVC_DIAG_PRECOMPILE_LAUNCH=load``): only the variants of
  the named Triton kernels (``CompiledKernel.name``: ``row_hash_kernel``, ``write_kernel``, ...) load their modules;
  the others are compiled only (``+`` between names: ``--configs`` splits on commas). Which of the canary's modules
  moves the GEMM.
- ``KVC_DIAG_DUMMY_MODULES=K`` (any server, the canary or not): right after sglang has built its KV pool (where the
  canary installs and precompiles), K tiny Triton modules are compiled, loaded and launched (``dummy_kernel.py``):
  a different K draws another placement of what loads after, on off servers as on canary servers (lease I: 8 and 64
  modules of a few KB did not move off's GEMM). ``KVC_DIAG_DUMMY_UNROLL=U``: each module stores U words, unrolled
  (its code grows with U: 4,096 stores are ~0.6 MB of cubin; the canary's 33 modules are ~2.2 MB), to ask whether
  code size alone moves it.

Applied when the target module is imported (an import hook installed by this directory's ``sitecustomize``).
"""

import functools
import os
import sys

RESERVE_ENV, SKIP_PRECOMPILE_ENV = "KVC_DIAG_RESERVE_BYTES", "KVC_DIAG_SKIP_PRECOMPILE"
POOL_ENV, EMPTY_CACHE_ENV = "KVC_DIAG_PRECOMPILE_POOL", "KVC_DIAG_PRECOMPILE_EMPTY_CACHE"
LAUNCH_ENV, DUMMY_ENV = "KVC_DIAG_PRECOMPILE_LAUNCH", "KVC_DIAG_DUMMY_MODULES"
LOAD_ONLY_ENV, UNROLL_ENV = "KVC_DIAG_PRECOMPILE_LOAD_ONLY", "KVC_DIAG_DUMMY_UNROLL"
ENVS = (RESERVE_ENV, SKIP_PRECOMPILE_ENV, POOL_ENV, EMPTY_CACHE_ENV, LAUNCH_ENV, DUMMY_ENV,
        LOAD_ONLY_ENV, UNROLL_ENV)  # any set: ``install``
RUNNER = "sglang.srt.model_executor.model_runner"
SIZER = "sglang.srt.model_executor.model_runner_kv_cache_mixin"  # 0.5.12's ModelRunnerKVCacheMixin
INSTALL = "kv_canary.adapter.install"


def _shrink(module, nbytes: int) -> None:
    cls = module.ModelRunnerKVCacheMixin
    original = getattr(cls, "_profile_available_bytes", None)
    if not callable(original):
        raise AttributeError(f"{RESERVE_ENV}: {cls.__name__} has no _profile_available_bytes (sglang 0.5.12's)")

    @functools.wraps(original)
    def profile(self, *args, **kwargs):
        available = original(self, *args, **kwargs)
        print(f"kvc_diag_reserve_bytes={nbytes} available_bytes_before={available} pid={os.getpid()} "
              "(bench ablation: the KV pool sized as if the canary held these back)", file=sys.stderr)
        return int(available) - nbytes

    cls._profile_available_bytes = profile


def _skip_precompile(module) -> None:
    def skipped(*_args, **_kwargs):
        print(f"kvc_diag_skip_precompile=1 pid={os.getpid()} (bench ablation: no precompile)", file=sys.stderr)

    module._precompile = skipped


def _precompile_apart(module, pool: bool, empty_cache: bool) -> None:
    original = module._precompile

    @functools.wraps(original)
    def precompile(*args, **kwargs):
        import torch

        if pool:
            private = torch.cuda.MemPool()
            with torch.cuda.use_mem_pool(private):
                original(*args, **kwargs)
        else:
            original(*args, **kwargs)
        if empty_cache:
            torch.cuda.empty_cache()
        print(f"kvc_diag_precompile pool={int(pool)} empty_cache={int(empty_cache)} pid={os.getpid()} "
              "(bench ablation)", file=sys.stderr)

    module._precompile = precompile


def _precompile_without_launches(module, load: bool, only: frozenset = frozenset()) -> None:
    """``only`` (with ``load``): the kernel names whose variants load their modules (empty: every kernel's)."""
    original = module._precompile

    @functools.wraps(original)
    def precompile(*args, **kwargs):
        from triton.backends.nvidia.driver import CudaLauncher
        from triton.compiler.compiler import CompiledKernel

        saved = {(CudaLauncher, "__call__"): CudaLauncher.__dict__["__call__"],
                 (CompiledKernel, "_init_handles"): CompiledKernel.__dict__["_init_handles"],
                 (CompiledKernel, "run"): CompiledKernel.__dict__["run"]}
        init_handles, run = saved[(CompiledKernel, "_init_handles")], saved[(CompiledKernel, "run")]
        loaded, seen = set(), set()

        def loads(kernel) -> bool:
            return load and (not only or kernel.name in only)

        def init_or_skip(kernel):
            seen.add(kernel.name)
            if loads(kernel):
                loaded.add(kernel.name)
                return init_handles(kernel)
            return None

        CudaLauncher.__call__ = lambda *_a, **_k: None
        if not load or only:
            CompiledKernel._init_handles = init_or_skip
            CompiledKernel.run = property(lambda kernel: run.fget(kernel) if loads(kernel) else _no_launch)
        try:
            original(*args, **kwargs)
        finally:
            for (cls, name), value in saved.items():
                setattr(cls, name, value)
        if only - loaded:
            raise SystemExit(f"{LOAD_ONLY_ENV}: no variant of {','.join(sorted(only - loaded))} was precompiled "
                             f"(the precompile's kernels: {','.join(sorted(seen))})")
        what = "load" if load else "compile"
        if only:
            what += f" only={','.join(sorted(only))} loaded={','.join(sorted(loaded))}"
        print(f"kvc_diag_precompile_launch={what} pid={os.getpid()} (bench ablation: no precompile launch reached "
              "the device)", file=sys.stderr)

    module._precompile = precompile


def _no_launch(*_args, **_kwargs):
    return None


def _dummy_modules_after_pool(module, count: int, unroll: int = 1) -> None:
    from device_bytes import after_pool

    def load(_runner, device) -> None:
        from dummy_kernel import load_modules

        cubin = load_modules(device, count, unroll)
        print(f"kvc_diag_dummy_modules={count} unroll={unroll} cubin_bytes={cubin} pid={os.getpid()} (bench "
              "ablation: loaded after the KV pool)", file=sys.stderr)

    after_pool(module.ModelRunner, DUMMY_ENV, load)


def _on_import(target: str, apply) -> None:
    if target in sys.modules:
        apply(sys.modules[target])
    else:
        from kv_canary._autoload import install_after_import

        install_after_import(target, apply)


def _need_idle(setting: str, why: str) -> None:
    if os.environ.get("KVC_DIAG_CANARY_IDLE") != "1":
        raise SystemExit(f"{setting} needs KVC_DIAG_CANARY_IDLE=1: {why}")


def _positive(env: str, what: str) -> int:
    """The variable's value, > 0 (0: unset)."""
    if not os.environ.get(env):
        return 0
    from device_bytes import positive_int

    return positive_int(env, what)


def install() -> None:
    if os.environ.get(RESERVE_ENV):
        from device_bytes import positive_bytes

        nbytes = positive_bytes(RESERVE_ENV)
        _on_import(SIZER, lambda module: _shrink(module, nbytes))
    if os.environ.get(SKIP_PRECOMPILE_ENV) == "1":
        _need_idle(f"{SKIP_PRECOMPILE_ENV}=1", "a working canary would compile its kernels while serving")
        _on_import(INSTALL, _skip_precompile)
    launch = os.environ.get(LAUNCH_ENV, "")
    if launch:
        if launch not in ("load", "compile"):
            raise SystemExit(f"{LAUNCH_ENV}={launch!r}: expected load or compile")
        _need_idle(LAUNCH_ENV, "a working canary must launch its kernels")
    only = frozenset(name for name in os.environ.get(LOAD_ONLY_ENV, "").split("+") if name)
    if os.environ.get(LOAD_ONLY_ENV) is not None and (launch != "load" or not only):
        raise SystemExit(f"{LOAD_ONLY_ENV}={os.environ[LOAD_ONLY_ENV]!r}: expected kernel names, with "
                         f"{LAUNCH_ENV}=load")
    if launch:
        _on_import(INSTALL, lambda module: _precompile_without_launches(module, launch == "load", only))
    count, unroll = _positive(DUMMY_ENV, "a number of modules"), _positive(UNROLL_ENV, "a number of stores")
    if unroll and not count:
        raise SystemExit(f"{UNROLL_ENV}={unroll}: only with {DUMMY_ENV}=K")
    if count:
        _on_import(RUNNER, lambda module: _dummy_modules_after_pool(module, count, unroll or 1))
    pool, empty = os.environ.get(POOL_ENV) == "1", os.environ.get(EMPTY_CACHE_ENV) == "1"
    if pool or empty:
        _on_import(INSTALL, lambda module: _precompile_apart(module, pool, empty))
