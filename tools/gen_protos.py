"""Generate the Python stubs of protos/rlfleet/v1 into services/v1 (rlfleet.v1).

python tools/gen_protos.py           # regenerate in place
python tools/gen_protos.py --check   # regenerate into a temp dir, fail on any diff
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT = ROOT / "services" / "v1"
HEADER = "# Generated from protos/rlfleet/v1 by tools/gen_protos.py. Do not edit.\n"


def generate(dest: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        well_known = Path(grpc_tools.__file__).parent / "_proto"
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *protos,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        dest.mkdir(parents=True, exist_ok=True)
        for f in sorted((Path(tmp) / "rlfleet" / "v1").iterdir()):
            (dest / f.name).write_text(HEADER + f.read_text())
        (dest / "__init__.py").write_text(HEADER)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if not args.check:
        if OUT.exists():
            shutil.rmtree(OUT)
        generate(OUT)
        print(f"generated {len(list(OUT.iterdir()))} files in {OUT.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "v1"
        generate(fresh)
        cmp = filecmp.dircmp(fresh, OUT)
        stale = cmp.left_only + cmp.right_only + cmp.diff_files
        if stale:
            print("stubs in services/v1 differ from protos/ (run `make protos`):", *sorted(stale))
            return 1
    print("protos-check: stubs match protos/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
