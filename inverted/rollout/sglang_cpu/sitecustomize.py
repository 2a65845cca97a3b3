"""Import stand-ins for the two CUDA-only packages real SGLang imports on its CPU path.

This file is not part of ``inverted``'s import tree: ``rollout.servers`` puts its folder on the
``PYTHONPATH`` of a real SGLang server launched on a CPU, so that Python runs it (as
``sitecustomize``) in the server and in every process the server spawns. It imports nothing of
``inverted``, because SGLang runs in an environment of its own.

SGLang 0.5.23 imports ``sgl_kernel`` (cache moves, allocation, speculative decoding) and
``torchvision`` (vision configs) at start-up once ``SGLANG_USE_CPU_ENGINE=1``, and calls neither
on the native PyTorch path (``docs/sglang-differences.md``). No CPU build of either exists on the
registries. A stand-in is used only where the real package is absent (the finder stands last on
``sys.meta_path``), satisfies ``import`` statements and nothing else, and raises
``StandInCalled`` naming what was called. It declines ``importlib.util.find_spec`` probes:
``transformers`` probes torchvision that way and would then take torchvision's code paths.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

PACKAGES = ("sgl_kernel", "torchvision")
CALLED = "[inverted] import stand-in called:"


class StandInCalled(RuntimeError):
    """SGLang called into a package that exists here only as an import stand-in."""


class _Missing:
    """Any attribute of a stand-in module: a class to subclass, a decorator or a function to call,
    an attribute to read further; it raises only when called."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> "_Missing":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        # said in the server's log too, where SGLang might catch the error: a test reads the log for this line
        print(f"{CALLED} {self._name}", file=sys.stderr, flush=True)
        raise StandInCalled(
            f"{self._name} was called, but {self._name.split('.')[0]} is an import stand-in here "
            "(real SGLang on a CPU, without CUDA kernels): this feature needs the real package"
        )

    def __mro_entries__(self, bases):
        return (object,)

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str) -> _Missing:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: list[str]):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] not in self.names or _probed():
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def _probed() -> bool:
    """Whether this lookup is an ``importlib.util.find_spec`` probe rather than an import."""
    probe = importlib.util.find_spec.__code__
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code is probe:
            return True
        frame = frame.f_back
    return False


def _absent(name: str) -> bool:
    return all(finder.find_spec(name, None) is None for finder in sys.meta_path if hasattr(finder, "find_spec"))


def install() -> list[str]:
    """Append the finder for each package that is not installed; return their names."""
    missing = [name for name in PACKAGES if _absent(name)]
    if missing:
        sys.meta_path.append(_StandInFinder(missing))
    return missing


_installed = install()
if _installed and not os.environ.get("INVERTED_SGLANG_STAND_INS"):  # said once, by the server's first process
    os.environ["INVERTED_SGLANG_STAND_INS"] = ",".join(_installed)
    print(
        f"[inverted] SGLang on a CPU: import stand-ins for {', '.join(_installed)} (absent here; any call raises); "
        f"SGLANG_USE_CPU_ENGINE={os.environ.get('SGLANG_USE_CPU_ENGINE')}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}",
        file=sys.stderr,
        flush=True,
    )
