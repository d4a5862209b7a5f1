"""Self-check and H3 block profile of this pack on your GPU, one JSON to share.

    python report.py [--out my-gpu.json] [--dram]

Run it with ComfyUI's Python from this folder's parent ComfyUI (or set COMFYUI_PATH). See tools/report.py.
"""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent
PACKAGE = "h3_fused_nvfp4"


def import_pack():
    # The folder an installed pack lives in may have any name (dashes included): import it under one name.
    if PACKAGE not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACKAGE, ROOT / "__init__.py",
                                                      submodule_search_locations=[str(ROOT)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = module
        spec.loader.exec_module(module)
    return sys.modules[PACKAGE]


if __name__ == "__main__":
    import_pack()
    from h3_fused_nvfp4.tools import report

    sys.exit(report.main())
