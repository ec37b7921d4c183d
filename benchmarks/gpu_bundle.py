"""Pack what the GPU checks need on a CUDA machine that has torch but no network.

Run here, where ``make venv sglang`` has built ``.venv`` and ``.sglang/<release>/``
(``.gpu`` is in ``.gitignore``):

    .venv/bin/python benchmarks/gpu_bundle.py [--python-version 3.12] [--out .gpu] [RELEASE ...]

It writes, under ``--out`` (default ``.gpu``, which git ignores):

- ``wheels/``: wheels for ``--python-version``: every package the package and its test
  runner need (``common.txt``, resolved from the installed packages' requirements), and
  every package with compiled code an SGLang release needs (``<release>.txt``), each at
  the version installed here (one file per version, shared by the lists);
- ``<release>/site.tar.xz``: the release's pure-Python packages as installed in
  ``.sglang/<release>/`` (their files and ``dist-info``, no ``__pycache__``; SGLang's
  compiled Rust extensions, which the HiCache classes do not import, left out).

``benchmarks/gpu_check.sh`` installs them into ``/tmp/gpu-site/`` on the GPU machine.
Left out everywhere: torch and what comes with it, numpy, pillow, triton (a CUDA
machine's torch image has them; a triton other than the pinned one serves the
HiCache classes). The listing shows every package and its size.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SKIP = {"torch", "numpy", "pillow", "triton", "hicache-obs", "pip", "setuptools", "wheel"}
PLATFORMS = [
    f"manylinux_2_{n}_x86_64" for n in (5, 12, 17, 24, 26, 27, 28, 31, 34, 35)
] + ["manylinux2014_x86_64", "manylinux1_x86_64", "any"]


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _dists(site: Path) -> dict[str, tuple[str, Path]]:
    """Distribution name -> (version, its dist-info folder) of ``site``."""
    out = {}
    for info in site.glob("*.dist-info"):
        meta = (info / "METADATA").read_text(encoding="utf-8", errors="replace")
        fields = dict(line.split(": ", 1) for line in meta.splitlines()[:20] if ": " in line)
        out[_norm(fields["Name"])] = (fields["Version"], info)
    return out


def _closure(roots: list[str], dists: dict[str, tuple[str, Path]]) -> list[str]:
    """What ``roots`` require, and what that requires (``Requires-Dist`` without an extra, for
    this Python), by name, as installed in ``dists``, with the roots themselves; a requirement
    that is not installed there is an error. ``SKIP`` (torch and the GPU image's own) is
    neither carried nor followed, except this package, whose requirements are."""
    from packaging.requirements import Requirement

    out: set[str] = set()
    todo = [_norm(r) for r in roots]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name != "hicache-obs" and (name in SKIP or name.startswith("nvidia-")):
            continue
        if name not in dists:
            raise SystemExit(f"gpu_bundle: {name} is required but not installed in .venv")
        if name not in SKIP:
            out.add(name)
        meta = (dists[name][1] / "METADATA").read_text(encoding="utf-8", errors="replace")
        for line in meta.splitlines():
            if line.startswith("Requires-Dist: "):
                req = Requirement(line.removeprefix("Requires-Dist: "))
                if req.marker is None or req.marker.evaluate({"extra": ""}):
                    todo.append(_norm(req.name))
    return sorted(out)


def _files(site: Path, info: Path) -> list[Path]:
    """The files the distribution installed in ``site`` (its RECORD), inside ``site`` only."""
    out = []
    for line in (info / "RECORD").read_text(encoding="utf-8").splitlines():
        rel = line.rsplit(",", 2)[0]
        if not rel or rel.startswith("..") or "__pycache__" in rel:
            continue
        path = site / rel
        if path.is_file():
            out.append(path)
    return out


def _compiled(files: list[Path], name: str) -> bool:
    native = [f for f in files if f.suffix in (".so", ".pyd")]
    if name == "sglang":  # its Rust extensions serve the server, not the HiCache classes
        return False
    return bool(native)


def _download(specs: list[str], dest: Path, python_version: str) -> None:
    if not specs:
        return
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    cmd += ["--python-version", python_version, "--implementation", "cp"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + specs, check=True)


def _wheel_names(specs: list[str], dest: Path) -> list[str]:
    out = []
    for spec in specs:
        name, version = spec.split("==")
        stem = name.replace("-", "_").lower()
        hits = [w.name for w in dest.glob("*.whl") if w.name.lower().startswith(f"{stem}-{version}-")]
        if len(hits) != 1:
            raise SystemExit(f"gpu_bundle: expected one wheel of {spec} in {dest}, found {hits}")
        out.append(hits[0])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("releases", nargs="*", default=["0.5.23", "0.5.10"])
    ap.add_argument("--python-version", default="3.12")
    ap.add_argument("--out", default=str(REPO / ".gpu"))
    args = ap.parse_args()
    out = Path(args.out)
    wheels = out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)

    # the package's own dependencies and the test runner's, as installed in .venv, resolved
    # through their Requires-Dist: all of them as wheels (torch and what SKIP names excepted)
    venv_site = next((REPO / ".venv" / "lib").glob("python3*/site-packages"))
    base = _dists(venv_site)
    common = [f"{n}=={base[n][0]}" for n in _closure(["hicache-obs", "pytest", "pytest-timeout", "hypothesis"], base)]
    _download(common, wheels, args.python_version)
    (out / "common.txt").write_text("".join(f"{w}\n" for w in _wheel_names(common, wheels)))
    total = sum((wheels / w).stat().st_size for w in _wheel_names(common, wheels))
    print(f"common: {len(common)} wheels, {total / 1e6:.1f} MB")

    for release in args.releases:
        site = next((REPO / ".sglang" / release / "lib").glob("python3*/site-packages"))
        compiled, pure = [], []
        for name, (version, info) in sorted(_dists(site).items()):
            if name in SKIP:
                continue
            files = _files(site, info)
            (compiled if _compiled(files, name) else pure).append((name, version, info, files))
        specs = [f"{n}=={v}" for n, v, _, _ in compiled]
        _download(specs, wheels, args.python_version)
        names = _wheel_names(specs, wheels)
        (out / f"{release}.txt").write_text("".join(f"{w}\n" for w in names))
        dest = out / release
        dest.mkdir(exist_ok=True)
        with tarfile.open(dest / "site.tar.xz", "w:xz", preset=6) as tar:
            for _name, _v, _info, files in pure:
                for f in files:
                    if f.suffix in (".so", ".pyd", ".pyc"):
                        continue
                    tar.add(f, arcname=str(f.relative_to(site)))
            marker = f"{release}\n".encode()
            entry = tarfile.TarInfo(".hicache-obs-gpu-bundle")
            entry.size = len(marker)
            tar.addfile(entry, io.BytesIO(marker))
        size = (dest / "site.tar.xz").stat().st_size
        wsize = sum((wheels / w).stat().st_size for w in names)
        print(f"{release}: {len(pure)} pure packages, site.tar.xz {size / 1e6:.1f} MB; "
              f"{len(names)} wheels {wsize / 1e6:.1f} MB: {', '.join(specs)}")  # fmt: skip
    every = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{out}: {every / 2**20:.1f} MiB in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
