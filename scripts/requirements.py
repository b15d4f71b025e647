"""Prints pyproject.toml's dependencies (with the extras named as arguments), one per line, for pip -r."""

import sys
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
requirements = list(project["dependencies"])
for extra in sys.argv[1:]:
    requirements += project["optional-dependencies"][extra]
print("\n".join(requirements))
