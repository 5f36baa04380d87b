"""benchmarks/ab.sh without a GPU: its arguments, its dry run, the kernel variants kept in
benchmarks/variants/ (each must still apply to the tree: a stale one fails here), and its run
loop with a stand-in for pip (A and B alternate, B's runs import from B's folder, a failing run
fails the whole), and its arms (--arm: B, C, D, ... against one A, each from its own folder)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from scripts import ROOT

SCRIPT = ROOT / "benchmarks" / "ab.sh"
VARIANTS = sorted((ROOT / "benchmarks" / "variants").glob("*.patch"))


def run(*args, env=None, timeout=120):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHON": sys.executable, **(env or {})})


@pytest.mark.parametrize("args, words", [
    (["--", "true"], "no --patch"),
    (["--patch", "no_such.patch", "--", "true"], "no patch file"),
    (["--patch", "{variant}"], "no command after --"),
    (["--patch", "{variant}", "--rounds", "0", "--", "true"], "--rounds must be"),
    (["--patch", "{variant}", "true"], "unknown argument 'true'"),
    (["--patch", "{variant}", "--a", "both", "--", "true"], "--a must be build, installed or none"),
])
def test_bad_arguments_exit_2_naming_the_problem(args, words):
    done = run(*(a.format(variant=VARIANTS[0]) for a in args))
    assert done.returncode == 2 and words in done.stderr, done


def test_dry_run_lists_builds_and_alternating_runs(tmp_path):
    done = run("--patch", VARIANTS[0], "--rounds", "3", "--dry-run", "--", "python3", "-c", "1",
               env={"AB_DIR": str(tmp_path)})
    assert done.returncode == 0, done
    lines = done.stdout.splitlines()
    assert lines[0].startswith("build A: ") and "JAX_NVFP4_CUDA_ARCHITECTURES=90a-real" in lines[0]
    assert lines[2].startswith("build B: ") and f"--target {tmp_path}/B ." in lines[2]
    assert [line.split(":")[0] for line in lines[3:]] == [
        f"run {side}, round {r}" for r in (1, 2, 3) for side in "AB"]
    assert all(f"PYTHONPATH={tmp_path}/B python3 -c 1" in line for line in lines[4::2])
    assert not (tmp_path / "tree").exists()  # a dry run touches nothing


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda p: p.name)
def test_every_kept_variant_applies_to_the_tree(tmp_path, variant):
    """A variant whose patch no longer applies is stale: update it or remove it (and its
    NOTES.md entry says what it was)."""
    done = run("--patch", variant, "--check", env={"AB_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stdout + done.stderr
    tree = tmp_path / "tree"
    assert sorted(p.name for p in tree.iterdir()) == [
        "CMakeLists.txt", "README.md", "ffi", "jax_nvfp4", "pyproject.toml"]  # what B builds
    # Applied, not only checked: every file the patch names differs from the tree's.
    named = [line[6:] for line in variant.read_text().splitlines() if line.startswith("+++ b/")]
    assert named and all((tree / n).read_text() != (ROOT / n).read_text() for n in named)


TEST_DIFFS = sorted((ROOT / "benchmarks" / "variants").glob("*_tests.diff"))


@pytest.mark.parametrize("diff", TEST_DIFFS, ids=lambda p: p.name)
def test_every_variants_tests_apply_to_the_tree(diff):
    """A variant's tests (NAME_tests.diff beside NAME.patch: ab.sh builds only the package, so
    a variant's tests are applied to the checkout that runs them) still apply to tests/, and
    touch nothing else."""
    assert (diff.parent / diff.name.replace("_tests.diff", ".patch")).exists()
    named = [line[6:] for line in diff.read_text().splitlines() if line.startswith("+++ b/")]
    assert named and all(n.startswith("tests/") for n in named), named
    done = subprocess.run(["git", "apply", "--check", str(diff)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_patch_that_does_not_apply_exits_2(tmp_path):
    # A patch whose one hunk removes a line the tree does not have (a context line would not
    # do: patch(1), ab.sh's fallback without git, may ignore a hunk's first and last context
    # lines), written here: the kept variants may only add lines.
    first, *context = (ROOT / "ffi" / "decode_cuda.cu").read_text().splitlines()[:3]
    for removed, status in [(first, 0), ("no_such_line_here", 2)]:
        patch = tmp_path / f"{status}.patch"
        patch.write_text("diff --git a/ffi/decode_cuda.cu b/ffi/decode_cuda.cu\n"
                         "--- a/ffi/decode_cuda.cu\n+++ b/ffi/decode_cuda.cu\n"
                         f"@@ -1,3 +1,3 @@\n-{removed}\n+// a line\n"
                         + "".join(f" {line}\n" for line in context))
        done = run("--patch", patch, "--check", env={"AB_DIR": str(tmp_path / f"ab{status}")})
        assert done.returncode == status, done  # the same patch with the tree's line applies
    assert "does not apply" in done.stderr, done


FAKE_PYTHON = """#!/bin/bash
# pip as far as ab.sh calls it: with --target, a package jax_nvfp4 in that folder (B); without,
# nothing (A: the package installed here), or a failure where FAKE_A_FAILS is set.
if [[ "$1 $2" == "-m pip" ]]; then
    target=""
    while (($#)); do [[ "$1" == --target ]] && target="$2"; shift; done
    if [[ -n "$target" ]]; then mkdir -p "$target/jax_nvfp4" && touch "$target/jax_nvfp4/__init__.py"
    elif [[ -n "${{FAKE_A_FAILS:-}}" ]]; then echo "fake build error"; exit 1; fi
    exit 0
fi
exec {python} "$@"
"""


#: A run's command for the pip stand-in's loop: which PYTHONPATH it had, where jax_nvfp4 came from.
PROBE = ("import os, jax_nvfp4; print('path=' + (os.environ.get('PYTHONPATH') or '-') "
         "+ ' from=' + os.path.dirname(os.path.dirname(jax_nvfp4.__file__)))")


def fake_python(tmp_path):
    """The pip stand-in (FAKE_PYTHON) as an executable in tmp_path."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    return fake


def run_with_fake_pip(tmp_path, *arm_args):
    """ab.sh with the pip stand-in over `arm_args`, each run printing PROBE's line, the caller's
    PYTHONPATH /no/such/extra: (the run, AB_DIR, the stand-in)."""
    fake, ab = fake_python(tmp_path), tmp_path / "ab"
    done = run(*arm_args, "--", sys.executable, "-P", "-c", PROBE,
               env={"AB_DIR": str(ab), "PYTHON": str(fake), "PYTHONPATH": "/no/such/extra"})
    return done, ab, fake


def test_run_loop_alternates_and_b_imports_from_its_folder(tmp_path):
    done, ab, fake = run_with_fake_pip(tmp_path, "--patch", VARIANTS[0])
    assert done.returncode == 0, done.stdout + done.stderr
    runs = [line for line in done.stdout.splitlines() if line.startswith(("== ", "path="))]
    assert runs[::3] == ["== A, round 1", "== B, round 1", "== A, round 2", "== B, round 2"]
    a, b = runs[1], runs[4]
    assert a.startswith("path=/no/such/extra from=") and f"{ab}" not in a, runs
    assert b == f"path={ab}/B:/no/such/extra from={ab}/B", runs  # B first, the caller's kept
    assert runs[7] == a and runs[10] == b, runs
    assert all(line.endswith(" s") and "exit 0" in line for line in runs[2::3]), runs
    assert f"ab: A imports " in done.stdout and f"B imports {ab}/B/jax_nvfp4/__init__.py" in (
        done.stdout)
    # One failing run fails the whole, and every run still runs.
    done = run("--patch", VARIANTS[0], "--rounds", "1", "--", "bash", "-c",
               '[[ -z "${PYTHONPATH:-}" ]]', env={"AB_DIR": str(ab), "PYTHON": str(fake),
                                                 "PYTHONPATH": ""})
    assert done.returncode == 1, done
    assert "== A, round 1: exit 0" in done.stdout and "== B, round 1: exit 1" in done.stdout


def test_a_installed_or_none_builds_no_a(tmp_path):
    """--a installed: A's runs use the package installed here, nothing built for it (a build
    would fail: FAKE_A_FAILS); --a none: B's runs alone."""
    fake = fake_python(tmp_path)
    env = {"AB_DIR": str(tmp_path / "ab"), "PYTHON": str(fake), "FAKE_A_FAILS": "1"}
    done = run("--patch", VARIANTS[0], "--a", "installed", "--rounds", "1", "--", "true", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "built A" not in done.stdout and "ab: built B" in done.stdout
    runs = [x for x in done.stdout.splitlines() if x.startswith("== ")]
    assert [x.split(":")[0] for x in runs] == ["== A, round 1"] * 2 + ["== B, round 1"] * 2
    assert "exit 0" in runs[1] and "exit 0" in runs[3], runs
    done = run("--patch", VARIANTS[0], "--a", "none", "--rounds", "2", "--", "true", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [x.split(":")[0] for x in done.stdout.splitlines() if x.startswith("== ")] == [
        "== B, round 1", "== B, round 1", "== B, round 2", "== B, round 2"]
    lines = run("--patch", VARIANTS[0], "--a", "none", "--dry-run", "--", "true",
                env=env).stdout.splitlines()
    assert lines[0] == "build A: none (no A runs)" and not any(
        x.startswith("run A") for x in lines), lines


def test_a_failed_build_stops_before_any_run(tmp_path):
    fake = fake_python(tmp_path)
    done = run("--patch", VARIANTS[0], "--", "true",
               env={"AB_DIR": str(tmp_path / "ab"), "PYTHON": str(fake), "FAKE_A_FAILS": "1"})
    assert done.returncode == 1 and "ab: build A failed" in done.stdout, done
    assert "fake build error" in done.stdout and "== A" not in done.stdout


def test_relative_ab_dir_and_patch_are_the_callers(tmp_path):
    """A relative AB_DIR and --patch are taken from the caller's folder, not the repository
    root the script works in."""
    (tmp_path / "v.patch").write_text(VARIANTS[0].read_text())
    done = subprocess.run(["bash", str(SCRIPT), "--patch", "v.patch", "--check"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "AB_DIR": "rel"})
    assert done.returncode == 0, done
    assert (tmp_path / "rel" / "tree" / "ffi").is_dir() and not (ROOT / "rel").exists()


# Arms (--arm): several variants against one A in one call.

def line_patch(path, rel, new, old=None):
    """A patch at `path` that replaces the first line of the tree's `rel` by `new` (one that
    does not apply where `old`, the line it removes, is not the tree's)."""
    first, *context = (ROOT / rel).read_text().splitlines()[:3]
    path.write_text(f"diff --git a/{rel} b/{rel}\n--- a/{rel}\n+++ b/{rel}\n"
                    f"@@ -1,3 +1,3 @@\n-{first if old is None else old}\n+{new}\n"
                    + "".join(f" {line}\n" for line in context))
    return path


@pytest.fixture
def patches(tmp_path):
    """Two patches that apply to the tree, alone or together (different files)."""
    return (line_patch(tmp_path / "p1.patch", "ffi/decode_cuda.cu", "// p1"),
            line_patch(tmp_path / "p2.patch", "jax_nvfp4/__init__.py", "# p2"))


def test_dry_run_lists_every_arm_and_runs_them_in_turn(tmp_path, patches):
    p1, p2 = patches
    ab = tmp_path / "ab"
    done = run("--patch", p1, "--arm", p2, "--arm", f"{p1},{p2}", "--rounds", "2", "--dry-run",
               "--", "python3", "-c", "1", env={"AB_DIR": str(ab)})
    assert done.returncode == 0, done
    lines = done.stdout.splitlines()
    assert lines[0].startswith("build A: ")
    # Each arm's tree (with its patches, in order) and build; B's paths as without arms.
    trees = {line.split(":")[0][5:]: line for line in lines if line.startswith("tree ")}
    builds = {line.split(":")[0][6:]: line for line in lines if line.startswith("build ")}
    assert list(trees) == list("BCD") and list(builds) == list("ABCD"), lines
    assert trees["B"].startswith(f"tree B: {ab}/tree = ") and trees["B"].endswith(f" + {p1}")
    assert trees["C"].startswith(f"tree C: {ab}/tree-c = ") and trees["C"].endswith(f" + {p2}")
    assert trees["D"].startswith(f"tree D: {ab}/tree-d = ") and trees["D"].endswith(
        f" + {p1} {p2}")
    for arm, x, tree in [("B", "b", "tree"), ("C", "c", "tree-c"), ("D", "d", "tree-d")]:
        assert builds[arm].startswith(f"build {arm}: (cd {ab}/{tree} && ") and builds[arm].endswith(
            f"--config-settings=build-dir={ab}/build-{x} --target {ab}/{arm} .)"), builds[arm]
    runs = [line for line in lines if line.startswith("run ")]
    assert [line.split(":")[0] for line in runs] == [
        f"run {side}, round {r}" for r in (1, 2) for side in "ABCD"]
    assert all(line.endswith(": python3 -c 1") for line in runs[::4]), runs
    for i, arm in enumerate("BCD", 1):
        assert all(line.endswith(f": PYTHONPATH={ab}/{arm} python3 -c 1") for line in runs[i::4])
    assert not ab.exists()  # a dry run touches nothing
    # --arm alone makes B (B's paths), and --a none runs the arms alone.
    lines = run("--arm", p2, "--a", "none", "--rounds", "1", "--dry-run", "--", "true",
                env={"AB_DIR": str(ab)}).stdout.splitlines()
    assert lines[1] == (f"tree B: {ab}/tree = this tree's pyproject.toml CMakeLists.txt"
                        f" README.md ffi jax_nvfp4 + {p2}"), lines
    assert lines[2].startswith("build B: ") and lines[2].endswith(
        f"build-dir={ab}/build-b --target {ab}/B .)"), lines
    assert [line for line in lines if line.startswith("run ")] == [
        f"run B, round 1: PYTHONPATH={ab}/B true"], lines
    assert not any(line.startswith(("tree C", "build C")) for line in lines), lines


@pytest.mark.parametrize("args, words", [
    (["--arm", "no_such.patch", "--", "true"], "no patch file 'no_such.patch'"),
    (["--arm", "{p1},no_such.patch", "--", "true"], "no patch file 'no_such.patch'"),
    (["--arm", "{p1},", "--", "true"], "empty patch file"),
    (["--arm", "", "--", "true"], "empty patch file"),
    (["--arm"], "--arm needs a value"),
    (["--arm", "{p1}"], "no command after --"),
])
def test_bad_arm_arguments_exit_2(patches, args, words):
    done = run(*(a.format(p1=patches[0]) for a in args))
    assert done.returncode == 2 and words in done.stderr and "--arm FILE[,FILE...]" in (
        done.stderr), done


def test_at_most_8_arms(tmp_path, patches):
    env = {"AB_DIR": str(tmp_path / "ab")}
    eight = [a for _ in range(8) for a in ("--arm", patches[0])]
    done = run(*eight, "--dry-run", "--", "true", env=env)  # B to I
    assert done.returncode == 0 and f"run I, round 1: PYTHONPATH={tmp_path}/ab/I true" in (
        done.stdout), done
    for nine in [[*eight, "--arm", patches[1]], ["--patch", patches[1], *eight]]:
        done = run(*nine, "--dry-run", "--", "true", env=env)
        assert done.returncode == 2 and "9 arms: at most 8 (B to I)" in done.stderr, done
        assert done.stdout == "", done


def test_check_applies_every_arm_to_its_own_tree(tmp_path, patches):
    p1, p2 = patches
    ab = tmp_path / "ab"
    done = run("--arm", p1, "--arm", f"{p2},{p1}", "--check",
               env={"AB_DIR": str(ab)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"tree B in {ab}/tree; tree C in {ab}/tree-c" in done.stdout, done
    b, c = ab / "tree", ab / "tree-c"
    assert sorted(p.name for p in c.iterdir()) == sorted(p.name for p in b.iterdir()) == [
        "CMakeLists.txt", "README.md", "ffi", "jax_nvfp4", "pyproject.toml"]
    decode, init = "ffi/decode_cuda.cu", "jax_nvfp4/__init__.py"
    assert (b / decode).read_text().startswith("// p1\n")  # B: p1 alone
    assert (b / init).read_text() == (ROOT / init).read_text()
    assert (c / decode).read_text().startswith("// p1\n")  # C: p2 then p1
    assert (c / init).read_text().startswith("# p2\n")
    assert not (ab / "B").exists() and not (ab / "C").exists()  # nothing built


def test_an_arm_whose_patch_does_not_apply_exits_2_naming_it(tmp_path, patches):
    fake = fake_python(tmp_path)
    bad = line_patch(tmp_path / "bad.patch", "ffi/decode_cuda.cu", "// bad",
                     old="no_such_line_here")
    env = {"AB_DIR": str(tmp_path / "ab"), "PYTHON": str(fake), "FAKE_A_FAILS": "1"}
    for args, arm in [(["--arm", patches[0], "--arm", bad], "C"),
                      (["--patch", patches[0], "--arm", patches[1], "--arm", f"{patches[1]},{bad}"],
                       "D"),
                      (["--arm", bad, "--arm", patches[0]], "B")]:
        for check in (["--check"], ["--", "true"]):  # and before any build (A's would fail)
            done = run(*args, *check, env=env)
            assert done.returncode == 2, done
            assert f"ab: {bad} does not apply to the tree (arm {arm})" in done.stderr, done
            assert "build A" not in done.stdout and "== " not in done.stdout, done


def test_run_loop_alternates_every_arm_each_importing_from_its_folder(tmp_path, patches):
    done, ab, fake = run_with_fake_pip(tmp_path, "--arm", patches[0], "--arm", patches[1])
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    # Both arms built before any run, each into its own folder with its own log.
    assert out.index("ab: built B") < out.index("ab: built C") < out.index("== A, round 1")
    assert (ab / "build-b.log").exists() and (ab / "build-c.log").exists()
    assert (ab / "tree-c").is_dir() and (ab / "C" / "jax_nvfp4" / "__init__.py").exists()
    assert (f"; B imports {ab}/B/jax_nvfp4/__init__.py; C imports {ab}/C/jax_nvfp4/__init__.py"
            in out), out
    runs = [line for line in out.splitlines() if line.startswith(("== ", "path="))]
    assert runs[::3] == [f"== {side}, round {r}" for r in (1, 2) for side in "ABC"], runs
    a, b, c = runs[1], runs[4], runs[7]
    assert a.startswith("path=/no/such/extra from=") and f"{ab}" not in a, runs
    assert b == f"path={ab}/B:/no/such/extra from={ab}/B", runs
    assert c == f"path={ab}/C:/no/such/extra from={ab}/C", runs
    assert runs[10] == a and runs[13] == b and runs[16] == c, runs
    assert all(line.endswith(" s") and "exit 0" in line for line in runs[2::3]), runs
    # One arm's failing run fails the whole; every run still runs.
    done = run("--arm", patches[0], "--arm", patches[1], "--a", "none", "--rounds", "1", "--",
               "bash", "-c", f'[[ "$PYTHONPATH" != {ab}/C ]]',
               env={"AB_DIR": str(ab), "PYTHON": str(fake), "PYTHONPATH": ""})
    assert done.returncode == 1, done
    assert "== B, round 1: exit 0" in done.stdout and "== C, round 1: exit 1" in done.stdout
    assert "== A" not in done.stdout
