"""Build the web console's vendored assets from the npm lockfile.

The console draws its charts with uPlot, a small maintained chart library from
npm. ``server/console/assets/package-lock.json`` pins it; this script installs
exactly that (``npm ci``) and copies the files the pages load into
``server/console/static/vendor/``, which are committed (the package carries them;
no CDN, no Node at run time). ``--check`` fails when the committed files differ
from what the lockfile builds, as ``gen_protos.py --check`` does for the stubs.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "server" / "console" / "assets"
VENDOR = ROOT / "server" / "console" / "static" / "vendor"
#: file in the npm package -> file served under /console/static/vendor/
FILES = {
    "uplot/dist/uPlot.iife.min.js": "uPlot.iife.min.js",
    "uplot/dist/uPlot.min.css": "uPlot.min.css",
    "uplot/LICENSE": "uPlot.LICENSE",
}


def install() -> None:
    npm = shutil.which("npm")
    if npm is None:
        sys.exit("build_console_assets: npm (Node.js 20+) is required")
    subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=ASSETS, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed files drift")
    args = parser.parse_args()
    install()
    drift = []
    for src, dst in FILES.items():
        built = (ASSETS / "node_modules" / src).read_bytes()
        target = VENDOR / dst
        if args.check:
            if not target.exists() or target.read_bytes() != built:
                drift.append(str(target.relative_to(ROOT)))
            continue
        VENDOR.mkdir(parents=True, exist_ok=True)
        target.write_bytes(built)
        print(f"wrote {target.relative_to(ROOT)}")
    if drift:
        print(
            "console assets drifted from server/console/assets/package-lock.json: "
            + ", ".join(drift)
            + "\nrun: python scripts/build_console_assets.py",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
