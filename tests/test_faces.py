"""Each package's face (its ``__init__``) offers names without hiding its modules: no name it exports is also
the name of one of its modules, which ``import package.module as m`` would then bind to the name instead."""

import importlib
import pkgutil

import auditor


def _packages():
    return [m.name for m in pkgutil.walk_packages(auditor.__path__, "auditor.") if m.ispkg]


def test_every_package_has_a_face_that_says_its_job():
    for name in _packages():
        assert importlib.import_module(name).__doc__, name


def test_no_name_a_face_offers_is_also_one_of_its_modules():
    clashes = []
    for name in _packages():
        package = importlib.import_module(name)
        modules = {module.name for module in pkgutil.iter_modules(package.__path__)}
        clashes += [f"{name}.{offered}" for offered in getattr(package, "__all__", []) if offered in modules]
    assert clashes == []


def test_a_module_imported_by_its_path_is_the_module():
    for name in _packages():
        if name == "auditor.integrations":  # optional extras, each behind its own library
            continue
        package = importlib.import_module(name)
        for module in pkgutil.iter_modules(package.__path__):
            full = f"{name}.{module.name}"
            assert importlib.import_module(full).__name__ == full
            assert getattr(package, module.name).__name__ == full, full
