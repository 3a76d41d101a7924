"""Package discovery for the remapped layout.

The repository keeps DESIGN.md's top-level folders (service/, client/,
migrations/) while the distribution imports them as tierckpt.service,
tierckpt.client and tierckpt.migrations; `tierckpt` itself is a namespace.
"""

from pathlib import Path

from setuptools import setup

ROOTS = {
    "tierckpt.service": "service",
    "tierckpt.client": "client",
    "tierckpt.migrations": "migrations",
}

packages: list[str] = []
for package, folder in ROOTS.items():
    for init in sorted(Path(folder).rglob("__init__.py")):
        relative = init.parent.relative_to(folder)
        packages.append(".".join([package, *relative.parts]))

setup(
    packages=packages,
    package_dir=ROOTS,
    package_data={"tierckpt.migrations": ["script.py.mako", "versions/*.py"]},
)
