"""Triton's interpreter, patched once for the test processes.

Before every kernel launch, and before every call of a `@triton.jit` helper from inside a kernel, the
interpreter (triton/runtime/interpreter.py, `_patch_lang`) swaps triton.language's builtins for its own,
walking the whole module with `inspect.getmembers` each time, and a launch swaps them back when it ends. A
helper called in a kernel's loop pays it on every iteration of every program: profiled, a fifth of a Triton
LoRA test's time (12,767 patches for 544 launches). The test processes interpret every kernel (there is no
compiled one to protect), and the interpreter already leaves a helper call's patches in place, so here
each set of language modules is patched once and stays patched: the kernels run the same code. Its mapping
of Triton types to numpy's is remembered too (below).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger(__name__)


class _KeptPatches:
    """The scope the interpreter restores after a launch: nothing to restore, the patches stay."""

    def restore(self) -> None:
        pass


def patch_the_language_once() -> None:
    """Make the interpreter's per-launch patching of triton.language a one-time patch (a no-op where
    this Triton's interpreter is not shaped as expected: the tests then run as slowly as before)."""
    import triton.language as tl
    from triton.runtime import interpreter

    original: Callable[[Any], Any] | None = getattr(interpreter, "_patch_lang", None)
    if original is None:
        log.warning("triton_interpreter_unpatched", reason="no triton.runtime.interpreter._patch_lang")
        return
    if getattr(original, "patched_once", False):
        return
    done: set[frozenset[int]] = set()
    langs_of: dict[Callable[..., Any], frozenset[int]] = {}

    def patch_once(fn: Callable[..., Any]) -> _KeptPatches:
        langs = langs_of.get(fn)
        if langs is None:
            modules = (v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
            langs = langs_of[fn] = frozenset(id(m) for m in modules)
        if langs not in done:
            original(fn)  # its scope is dropped: the patches are never undone
            done.add(langs)
        return _KeptPatches()

    patch_once.patched_once = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_once
    _remember_numpy_dtypes(interpreter)


def _remember_numpy_dtypes(interpreter: Any) -> None:
    """The interpreter maps a Triton type to its numpy dtype at every load, store, cast and binary op by
    building a 17-entry dict each time: 263,443 calls and 6% of the Triton LoRA test's profile. The answer
    depends on the scalar type alone (a block's is its element's; every pointer's is uint64), so each
    scalar's is kept; pointers still go to the interpreter's function (their types do not hash)."""
    import triton.language as tl

    original: Callable[[Any], Any] | None = getattr(interpreter, "_get_np_dtype", None)
    if original is None or getattr(original, "remembered", False):
        return
    known: dict[Any, Any] = {}

    def remembered(tt_dtype: Any) -> Any:
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return original(tt_dtype)
        found = known.get(scalar)
        if found is None:
            found = known[scalar] = original(scalar)
        return found

    remembered.remembered = True  # type: ignore[attr-defined]
    interpreter._get_np_dtype = remembered
