"""Check that a Java runtime recent enough for Spark is available, before starting Spark.

Without this check a missing or old Java shows up as a py4j gateway error or a
``UnsupportedClassVersionError`` deep in Spark's start-up output.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from statebackend.errors import ConfigurationError

# `java -version` prints e.g. `openjdk version "17.0.15" 2025-04-15` or `java version "1.8.0_292"`.
_VERSION_RE = re.compile(r'version "(\d+)(?:\.(\d+))?[^"]*"')


def _install_hint(min_major: int) -> str:
    return (
        f"Install a Java {min_major}+ runtime (e.g. `apt-get install"
        f" openjdk-{min_major}-jre-headless`) and put it on PATH,"
        " or set JAVA_HOME to its directory."
    )


def find_java() -> str | None:
    """Return the `java` executable Spark will use: `$JAVA_HOME/bin/java`, else `java` on PATH."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        candidate = os.path.join(java_home, "bin", "java")
        return candidate if os.access(candidate, os.X_OK) else None
    return shutil.which("java")


def parse_java_major(version_output: str) -> int | None:
    """Return the major version from `java -version` output (8 for "1.8.0"), or None."""
    match = _VERSION_RE.search(version_output)
    if match is None:
        return None
    major = int(match.group(1))
    if major == 1 and match.group(2) is not None:
        return int(match.group(2))
    return major


def require_java(min_major: int = 17) -> int:
    """Check that Java >= `min_major` is available the way Spark finds it; return its major.

    Raises:
        ConfigurationError: Java is missing, does not run, or is older than `min_major`; the
            message says what to install or set.
    """
    java = find_java()
    if java is None:
        where = (
            f"JAVA_HOME={os.environ['JAVA_HOME']!r} has no executable bin/java"
            if os.environ.get("JAVA_HOME")
            else "no `java` on PATH and JAVA_HOME is not set"
        )
        raise ConfigurationError(
            f"Spark needs Java {min_major}+, but {where}. " + _install_hint(min_major)
        )
    try:
        proc = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigurationError(
            f"Spark needs Java {min_major}+, but running `{java} -version` failed: {exc}. "
            + _install_hint(min_major)
        ) from exc
    output = proc.stderr + proc.stdout
    major = parse_java_major(output)
    if proc.returncode != 0 or major is None:
        raise ConfigurationError(
            f"Spark needs Java {min_major}+, but `{java} -version` did not report a version"
            f" (exit {proc.returncode}): {output.strip()[:200]!r}. " + _install_hint(min_major)
        )
    if major < min_major:
        raise ConfigurationError(
            f"Spark needs Java {min_major}+, but `{java}` is Java {major}. "
            + _install_hint(min_major)
        )
    return major


def make_spark_home(target: Path) -> Path:
    """Make ``target`` a SPARK_HOME whose entries are symlinks into the pyspark package.

    For ``local-cluster`` masters: their in-process standalone Worker writes executor work
    directories to ``$SPARK_HOME/work`` (ignoring SPARK_WORKER_DIR), which must not be
    inside site-packages. Set SPARK_HOME to it before the JVM starts.
    """
    import pyspark

    package_dir = Path(pyspark.__file__).parent
    target.mkdir(parents=True, exist_ok=True)
    for entry in package_dir.iterdir():
        if entry.name != "work" and not (target / entry.name).exists():
            (target / entry.name).symlink_to(entry)
    return target
