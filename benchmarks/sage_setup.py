"""Run SageAttention's own setup.py (in the current folder) with only the extensions named in $SAGE_EXTENSIONS.

    cd <copy of the SageAttention source> && SAGE_EXTENSIONS="sageattention._qattn_sm90 sageattention._fused" \
        python <this pack>/benchmarks/sage_setup.py build_ext --inplace

setup.py builds every extension its target architectures allow; on sm_90 ``sageattn()`` only calls
``_qattn_sm90`` and ``_fused`` (the sm80 / sm89 kernels are optional imports), so building those two alone
saves most of the compile time. An empty or unset $SAGE_EXTENSIONS runs setup.py unchanged.
"""

import os
import runpy
import sys

import setuptools


def main() -> None:
    keep = os.environ.get("SAGE_EXTENSIONS", "").split()
    original = setuptools.setup

    def setup(**kwargs):
        extensions = kwargs.get("ext_modules") or []
        names = [e.name for e in extensions]
        if keep:
            missing = [n for n in keep if n not in names]
            if missing:
                sys.exit(f"sage_setup.py: setup.py defines no extension {missing} (it defines {names}); check "
                         "TORCH_CUDA_ARCH_LIST")
            kwargs["ext_modules"] = [e for e in extensions if e.name in keep]
        print(f"sage_setup.py: building {[e.name for e in kwargs.get('ext_modules') or []]} of {names}", flush=True)
        return original(**kwargs)

    setuptools.setup = setup
    sys.argv = ["setup.py", *sys.argv[1:]]
    sys.path.insert(0, os.getcwd())
    runpy.run_path("setup.py", run_name="__main__")


if __name__ == "__main__":
    main()
