"""Options shared by the commands that sweep a dataset: ``--ray [ADDRESS]`` and ``--workers``.

``--ray`` alone starts a local Ray; ``--ray ADDRESS`` joins a cluster. Click options cannot take an optional
value, so ``--ray`` is a flag and :func:`split_ray_address` (run on ``sys.argv`` by ``lenscope``'s entry
point) turns ``--ray ADDRESS`` into ``--ray --ray-address ADDRESS``.
"""

from __future__ import annotations

import re

import typer

RAY_HELP = ("Spread the examples over Ray workers (each loads the model once): `--ray` alone starts a local Ray on "
            "this machine; `--ray ADDRESS` joins a cluster (e.g. auto, ray://head:10001). Same files and results "
            "as without it; --resume works the same.")
_ADDRESS = re.compile(r"^(auto|local|ray://\S+|[\w.\-]+:\d+)$")


def ray_option():
    return typer.Option(False, "--ray", help=RAY_HELP)


def ray_address_option():
    return typer.Option(None, "--ray-address", help="The Ray cluster to join (the same as `--ray ADDRESS`).")


def workers_option():
    return typer.Option(2, "--workers", help="Ray workers (with --ray).", min=1)


def ray_target(ray: bool, address: str | None):
    """What :func:`lenscope.distributed.run_sweep` takes: None (no Ray), True (local) or an address."""
    if address is not None:
        return True if address == "local" else address
    return True if ray else None


def split_ray_address(argv: list[str]) -> list[str]:
    """``[..., "--ray", "auto", ...]`` -> ``[..., "--ray", "--ray-address", "auto", ...]``; other argv unchanged."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--ray="):
            out += ["--ray", "--ray-address", a.split("=", 1)[1]]
        elif a == "--ray" and i + 1 < len(argv) and _ADDRESS.match(argv[i + 1]):
            out += ["--ray", "--ray-address", argv[i + 1]]
            i += 1
        else:
            out.append(a)
        i += 1
    return out
