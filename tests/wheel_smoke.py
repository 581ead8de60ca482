"""Loads trainstream's native module straight from an installed wheel, without importing torch
(the package proper needs torch; the extension must not), and runs one small AdamW step."""

from __future__ import annotations

import array
import importlib.machinery
import importlib.util
import pathlib
import sys


def main() -> int:
    spec = importlib.util.find_spec("trainstream")
    assert spec is not None and spec.submodule_search_locations, "trainstream is not installed"
    package = pathlib.Path(next(iter(spec.submodule_search_locations)))
    candidates = sorted(package.glob("_C*.so"))
    assert candidates, f"no _C extension in {package}"
    loader = importlib.machinery.ExtensionFileLoader("trainstream._C", str(candidates[0]))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("trainstream._C", loader))
    loader.exec_module(module)
    n = 1000
    p, g, m, v = (array.array("f", [x] * n) for x in (1.0, 0.5, 0.0, 0.0))
    address = lambda a: a.buffer_info()[0]  # noqa: E731
    module.HostAdamW(1).step(address(p), address(g), "float32", address(m), address(v), n,
                             lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    assert abs(p[0] - 0.9) < 1e-5, p[0]  # the first Adam step moves by lr
    print("wheel ok:", module.__version__, "cuda" if module.has_cuda else "cpu-only", module.cpu_features())
    return 0


if __name__ == "__main__":
    sys.exit(main())
