"""The API reference is complete: every public module has a page, and every name a page's
module exports is one the documentation generator can see (``dir``) with its own docstring."""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
# The modules a user imports by name; each needs a reference page.
PUBLIC_MODULES = [
    "hvd_spark", "hvd_spark.torch", "hvd_spark.torch.elastic", "hvd_spark.tensorflow",
    "hvd_spark.tensorflow.callbacks", "hvd_spark.tensorflow.elastic", "hvd_spark.keras",
    "hvd_spark.estimator", "hvd_spark.data", "hvd_spark.collectives", "hvd_spark.errors",
    "hvd_spark.task",
]


def _pages() -> dict[str, Path]:
    found = {}
    for page in (DOCS / "reference").glob("*.md"):
        for module in re.findall(r"^::: ([\w.]+)", page.read_text(), flags=re.M):
            found[module] = page
    return found


def test_every_public_module_has_a_reference_page():
    missing = sorted(set(PUBLIC_MODULES) - set(_pages()))
    assert not missing, f"no docs/reference page renders {missing}"


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_exported_name_is_visible_to_the_reference(module_name):
    module = importlib.import_module(module_name)
    # Without __all__ (hvd_spark.errors): the public names the module defines itself.
    exported = set(getattr(module, "__all__", None) or (
        name for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module_name))
    assert exported, f"{module_name} exports nothing"
    # mkdocstrings lists what dir() shows: lazily imported names need a __dir__.
    assert not exported - set(dir(module)), f"{module_name}: {exported - set(dir(module))}"
    for name in exported:
        assert getattr(module, name) is not None


def test_estimator_params_show_their_own_description():
    from hvd_spark.estimator import KerasEstimator, TorchEstimator
    from hvd_spark.estimator.params import SHARED_PARAMS

    for cls in (TorchEstimator, KerasEstimator):
        for name, doc, _, _ in SHARED_PARAMS:
            text = getattr(cls, name).__doc__
            assert "self-contained" not in text
            assert text.lower().startswith(doc.lower()), (cls.__name__, name, text)
    assert TorchEstimator(num_proc=1).batch_size.__doc__.endswith("Default: 32.")


def test_prepare_data_has_one_meaning():
    import hvd_spark.data as data
    from hvd_spark.data import dataset_index, writer

    assert "prepare_data" not in data.__all__ and "write_dataset" in data.__all__
    # The writer's old name still works, once warned; Horovod's context manager keeps its own.
    with pytest.warns(DeprecationWarning, match="write_dataset"):
        assert data.prepare_data is writer.write_dataset
    assert not hasattr(writer, "prepare_data")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dataset_index.prepare_data.__module__ == "hvd_spark.data.dataset_index"


def test_docstrings_point_to_pages_and_sections_that_exist():
    package = DOCS.parent / "hvd_spark"
    pointers = []
    for source in package.rglob("*.py"):
        text = source.read_text()
        assert "README (" not in text and "the README," not in text, (
            f"{source}: point to a docs/ page, not a README section")
        pointers += [(source, page, section) for page, section in re.findall(
            r"``(docs/[\w/.-]+\.md)``(?:,? \(?\"([^\"]+)\")?", text)]
    assert pointers
    for source, page, section in pointers:
        path = DOCS.parent / page
        assert path.is_file(), f"{source} points to {page}, which does not exist"
        if section:
            assert re.search(rf"^#+ {re.escape(section)}$", path.read_text(), flags=re.M), (
                f"{source} points to the section {section!r} of {page}, which has none")


def test_the_collectives_front_door_has_one_list_and_no_plumbing():
    import hvd_spark.collectives as C
    from hvd_spark.collectives import _plumbing, api

    # One list: the package's names are the api module's, plus the elastic submodule.
    assert sorted(C.__all__) == sorted([*api.__all__, "elastic"])
    assert all(getattr(C, name) is getattr(api, name) for name in api.__all__)
    plumbing = set(_plumbing.__all__)
    assert plumbing == {"auto_name", "current_engine", "group_base_name", "report_failure",
                        "report_grouped_failure"}
    assert not plumbing & set(C.__all__)
    for name in plumbing:
        assert not hasattr(api, name), f"api still exports the plumbing name {name}"
        with pytest.raises(AttributeError):
            getattr(C, name)
