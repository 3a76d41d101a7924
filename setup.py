"""Package list for the remapped layout.

The repository keeps its top-level folders (service/, client/, migrations/)
while the distribution imports them as tierckpt.service, tierckpt.client and
tierckpt.migrations; `tierckpt` itself is a namespace. pyproject.toml holds
the rest of the configuration; only the package list is computed here,
because pyproject.toml cannot derive it from remapped folders and a
hand-written list would silently leave out the next new subpackage.

Every folder holding a module is a package, with or without an __init__.py
(migrations/versions/ has none: Alembic loads its files by path).
"""

import warnings
from pathlib import Path

from setuptools import setup
from setuptools.warnings import InformationOnly

HERE = Path(__file__).resolve().parent

ROOTS = {
    "tierckpt.service": "service",
    "tierckpt.client": "client",
    "tierckpt.migrations": "migrations",
}


def packages_under(package: str, folder: str) -> list[str]:
    found = []
    for directory in sorted({path.parent for path in (HERE / folder).rglob("*.py")}):
        relative = directory.relative_to(HERE / folder).parts
        if any(part == "__pycache__" or part.startswith(".") for part in relative):
            continue
        found.append(".".join([package, *relative]))
    return found


# An editable install of remapped folders goes through setuptools' import hook,
# and setuptools then always adds a note (as a warning, for want of another
# channel) that a folder named like the package in the working directory would
# shadow the install. No folder here is named `tierckpt`, so the note does not
# apply; it is silenced only while that holds.
if not (HERE / "tierckpt").exists():
    warnings.filterwarnings("ignore", message="Editable installation", category=InformationOnly)

setup(
    packages=[name for package, folder in ROOTS.items() for name in packages_under(package, folder)]
)
