"""Importing a command-line script of scripts/ in tests, as a module (for scripts whose logic has no library home,
such as build_doc_corpus.py)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py as the module `name`, loaded once per process. The module is registered in sys.modules,
    where dataclasses look their module up and where a multiprocessing worker finds the functions it is sent."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
