"""The fence: every hook target a line relies on must exist, with the signature the line expects, before it installs.

``release_targets.json`` (written by ``scripts/release_targets.py`` from each release's wheel, statically) holds
the normalized signature of every hook target of every line on every release from 0.5.12 to 0.5.23, and whether
the release ships sglang's in-tree kv_canary. A line expects the signatures of the release it was built on
(``SglangLine.name``). At startup ``observed_targets`` reads the running sglang (``inspect.signature``) and
``differences`` compares: any difference refuses the canary (``--kv-canary`` other than ``none``), naming the
release, the target and what differs, and nothing of the line is installed. The same comparison over the stored
table decides which line covers which release (``test_release_fence``).

A signature is written as its parameters' names and kinds, ``=`` marking a default (values and annotations
left out: they are source text statically and objects at runtime): ``(self, forward_batch, pp_proxy_tensors=,
*, reinit_attn_backend=, **kwargs)``. ``(generated)``: a ``@dataclass`` method with no source of its own.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

TARGETS_FILE = os.path.join(os.path.dirname(__file__), "release_targets.json")
GENERATED = "(generated)"
MISSING = None  # the target does not exist on that release
UNCHECKED = "(unchecked)"  # sglang's module exists but does not import here (a missing optional dependency)

# (name, kind, has_default); kind as inspect.Parameter kinds' names
Param = Tuple[str, str, bool]


def format_params(params: Sequence[Param]) -> str:
    """``(a, b=, /, c, *args, d=, **kw)``, the one form both the wheel's AST and the running sglang are written in."""
    out: List[str] = []
    kinds = [kind for _, kind, _ in params]
    star_written = False
    for i, (name, kind, has_default) in enumerate(params):
        if kind == "KEYWORD_ONLY" and not star_written and "VAR_POSITIONAL" not in kinds:
            out.append("*")
            star_written = True
        if kind == "VAR_POSITIONAL":
            out.append(f"*{name}")
            continue
        if kind == "VAR_KEYWORD":
            out.append(f"**{name}")
            continue
        out.append(f"{name}=" if has_default else name)
        if kind == "POSITIONAL_ONLY" and (i + 1 == len(params) or params[i + 1][1] != "POSITIONAL_ONLY"):
            out.append("/")
    return "(" + ", ".join(out) + ")"


def signature_of(func) -> str:
    """The running function's signature in ``format_params``'s form."""
    code = getattr(func, "__code__", None)
    if code is not None and code.co_filename.startswith("<"):
        return GENERATED  # dataclass __init__ & co: built by exec, no source of its own
    sig = inspect.signature(func)
    return format_params([(p.name, p.kind.name, p.default is not inspect.Parameter.empty)
                          for p in sig.parameters.values()])


def observe(target: str) -> Optional[str]:
    """``target``'s signature on the running sglang: MISSING if it does not exist, UNCHECKED if its module exists but
    does not import here (its table is then required only with a flag; ``check_hooks_applied`` backs it)."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            spec = importlib.util.find_spec(module_name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        try:
            obj = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 -- a dependency of sglang's module is missing here, not the target
            return UNCHECKED
        for name in parts[cut:-1]:
            obj = getattr(obj, name, None)
            if obj is None:
                return MISSING
        raw = inspect.getattr_static(obj, parts[-1], None)
        if raw is None:
            return MISSING
        if isinstance(raw, (classmethod, staticmethod)):
            raw = raw.__func__
        if not callable(raw):
            return MISSING
        try:
            return signature_of(raw)
        except (TypeError, ValueError):
            return MISSING
    return MISSING


def observed_targets(targets: Iterable[str]) -> Dict[str, Optional[str]]:
    return {target: observe(target) for target in sorted(set(targets))}


def load_table(path: str = TARGETS_FILE) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def release_signatures(table: Mapping, version: str) -> Dict[str, Optional[str]]:
    """Every stored target's signature on ``version`` (MISSING where the target does not exist there)."""
    out: Dict[str, Optional[str]] = {}
    for target, variants in table["targets"].items():
        out[target] = MISSING
        for sig, versions in variants:
            if version in versions:
                out[target] = sig
    return out


def expected_signatures(line, table: Optional[Mapping] = None) -> Dict[str, Optional[str]]:
    """What ``line`` expects: each of its hook targets' signature on the release it was built on."""
    table = load_table() if table is None else table
    base = release_signatures(table, line.name)
    return {target: base.get(target, MISSING) for target in line.all_hooks()}


def differences(line, observed: Mapping[str, Optional[str]], table: Optional[Mapping] = None) -> List[str]:
    """One phrase per hook target of ``line`` that differs from what it expects (empty: the fence lets it in)."""
    out = []
    for target, want in sorted(expected_signatures(line, table).items()):
        got = observed.get(target, MISSING)
        if got == UNCHECKED or got == want:
            continue
        if want is MISSING:
            out.append(f"{target} exists here but not on sglang {line.name} (the line's table is out of date)")
        elif got is MISSING:
            out.append(f"{target} is missing (sglang {line.name}: {want})")
        else:
            out.append(f"{target} is {got} (sglang {line.name}: {want})")
    return out
