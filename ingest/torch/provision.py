"""A CPU-only PyTorch from PyPI, installed once per machine into a cache outside the repo.

PyTorch is a test and optional dependency of rankwatch. PyPI's Linux wheel is a CUDA build: the
`torch` wheel itself (~540 MB) plus ~2 GB of `nvidia-*`/`cuda-*` wheels that its libraries name as
DT_NEEDED (libcudart, libcublas, libcudnn, libnccl, …). For CPU-only use none of those libraries is
ever *called*: the loader only has to find them. So we install

1. `torch` with `--no-deps`, plus its small pure-Python dependencies, into
   ``<cache>/torch-<version>/site`` (a ``pip install --target``);
2. generated **stub libraries** for every CUDA soname the torch libraries need and the machine
   lacks, in ``site/nvidia/cu13/lib`` — a directory already on the torch libraries' RPATH. Each
   stub carries the soname, the symbol-version nodes the torch libraries ask for, and every symbol
   they import from it, as a function returning error 100 (cudaErrorNoDevice) or, for
   ``*GetErrorString``/``*GetErrorName``, a message. `torch.cuda.is_available()` is then False and
   everything on the CPU (autograd, gloo) works.

That is the torch wheel alone — about a fifth of the CUDA build's downloads and a quarter of
its disk — and stubs built in seconds. A machine with a GPU should install torch normally; this is
for CPU test machines and CI.

`torch_site()` returns the site directory (installing on first use, with progress on stderr) or
None with the reason in `last_error`; callers add it to ``sys.path``/``PYTHONPATH``.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TORCH_VERSION = os.environ.get("RANKWATCH_TORCH_VERSION", "2.15.0")
PURE_DEPS = ("filelock", "typing-extensions>=4.13", "sympy>=1.13.3", "mpmath", "networkx",
             "jinja2", "markupsafe", "fsspec")
#: Symbol-version names that do not spell their library's soname.
VERSION_SONAME = {"NVSHMEM": "libnvshmem_host.so.3"}
#: Library that receives the unversioned imports (it is NEEDED by libtorch_cuda, so in scope).
UNVERSIONED_HOME = "libnccl.so.2"
STUB_DIR = Path("nvidia/cu13/lib")

last_error = ""


def cache_root() -> Path:
    base = os.environ.get("RANKWATCH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")), "rankwatch")
    return Path(base)


def _say(msg: str) -> None:
    print(f"[rankwatch torch] {msg}", file=sys.__stderr__, flush=True)


def _run(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def build_stubs(lib_dir: Path, out: Path) -> list[str]:
    """Write a stub for each soname that the libraries in `lib_dir` need and the system lacks."""
    libs = sorted(lib_dir.glob("*.so*"))
    defined: set[str] = set()
    needed: set[str] = set()
    by_version: dict[str, set[str]] = collections.defaultdict(set)
    unversioned: set[str] = set()
    for so in libs:
        for line in _run(["nm", "-D", "--defined-only", str(so)]).splitlines():
            parts = line.split()
            if len(parts) >= 3:
                defined.add(parts[2].split("@")[0])
        needed |= set(re.findall(r"Shared library: \[(.+?)\]", _run(["readelf", "-d", str(so)])))
        for line in _run(["nm", "-D", "--undefined-only", str(so)]).splitlines():
            parts = line.split()
            if len(parts) != 2 or parts[0] != "U":
                continue
            name, _, version = parts[1].partition("@")
            if version:
                by_version[version.lstrip("@")].add(name)
            else:
                unversioned.add(name)
    system = _run(["ldconfig", "-p"])
    present = {p.name for p in libs}
    missing = sorted(n for n in needed if n not in present and n not in system)
    unversioned -= defined
    unversioned = {s for s in unversioned if not s.startswith(("Py", "_Py", "_Z"))}
    out.mkdir(parents=True, exist_ok=True)
    for soname in missing:
        versions = {v for v in by_version if v == soname or VERSION_SONAME.get(v) == soname}
        symbols = set().union(*(by_version[v] for v in versions)) if versions else set()
        if soname == UNVERSIONED_HOME:
            symbols |= unversioned
        _compile_stub(out, soname, symbols, versions)
    return missing


def _compile_stub(out: Path, soname: str, symbols: set[str], versions: set[str]) -> None:
    lines = ['static const char rw_msg[] = "CUDA is not installed (rankwatch CPU-only stub)";']
    for s in sorted(symbols):
        if s.endswith(("GetErrorString", "GetErrorName")):
            lines.append(f"const char *{s}(void) {{ return rw_msg; }}")
        else:
            lines.append(f"int {s}(void) {{ return 100; }}")
    src, vmap = out / f"{soname}.c", out / f"{soname}.map"
    src.write_text("\n".join(lines) + "\n")
    vmap.write_text("".join(f"{v} {{ global: *; }};\n" for v in sorted(versions))
                    or "{ global: *; };\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-w", "-o", str(out / soname),
                    f"-Wl,-soname,{soname}", f"-Wl,--version-script={vmap}", str(src)],
                   check=True)
    src.unlink()
    vmap.unlink()


def install(target: Path) -> None:
    """pip-install torch (no CUDA deps) and its pure deps into `target`/site, then the stubs."""
    tmp = Path(tempfile.mkdtemp(prefix="torch-", dir=target.parent))
    site = tmp / "site"
    t0 = time.monotonic()
    _say(f"installing torch {TORCH_VERSION} (CPU-only, ~540 MB download, once per machine) "
         f"into {target} …")
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet",
                        "--disable-pip-version-check", "--target", str(site),
                        f"torch=={TORCH_VERSION}", *PURE_DEPS], check=True)
        _say(f"pip done in {time.monotonic() - t0:.0f}s; building CUDA stub libraries …")
        stubs = build_stubs(site / "torch" / "lib", site / STUB_DIR)
        _say(f"{len(stubs)} stubs; checking `import torch` …")
        check = ("import torch, torch.distributed as d; "
                 "assert d.is_available() and d.is_gloo_available(); print(torch.__version__)")
        env = {**os.environ, "PYTHONPATH": str(site)}
        subprocess.run([sys.executable, "-c", check], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
        _say(f"torch ready in {time.monotonic() - t0:.0f}s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def torch_site(auto_install: bool = True) -> Path | None:
    """The site dir holding a working torch, installing it when missing; None if impossible.

    A torch importable without help (installed in the environment) wins: returns None and
    `last_error` is "" — check `have_torch()`.
    """
    global last_error
    target = cache_root() / f"torch-{TORCH_VERSION}"
    site = target / "site"
    if (site / "torch" / "__init__.py").exists():
        return site
    if not auto_install or os.environ.get("RANKWATCH_NO_TORCH_INSTALL"):
        last_error = f"torch not installed at {site} (auto install disabled)"
        return None
    if sys.platform != "linux" or not shutil.which("cc") or not shutil.which("nm"):
        last_error = "CPU torch provisioning needs Linux with cc and nm (binutils)"
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.parent / f".torch-{TORCH_VERSION}.lock"
    import fcntl

    with open(lock, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # one installer per machine; others wait, then reuse
        if not (site / "torch" / "__init__.py").exists():
            try:
                install(target)
            except (subprocess.CalledProcessError, OSError) as e:
                last_error = f"installing torch {TORCH_VERSION} failed: {e}"
                return None
    return site


def ensure_importable() -> str:
    """Make `import torch` work in this process; returns "" or the reason it cannot."""
    try:
        import torch

        return ""
    except ImportError:
        pass
    site = torch_site()
    if site is None:
        return last_error
    if str(site) not in sys.path:
        sys.path.append(str(site))
    try:
        import torch  # noqa: F401
    except Exception as e:  # a broken install: say so rather than crash collection
        return f"import torch from {site} failed: {e}"
    return ""


def pythonpath_with_torch(env: dict[str, str]) -> dict[str, str]:
    """`env` with the torch site appended to PYTHONPATH (for subprocesses: torchrun, workers)."""
    site = torch_site()
    if site is None:
        return env
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join([*parts, str(site)])}
