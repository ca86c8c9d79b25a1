"""Write a directory's files under temporary names and rename them into place at the end.

:meth:`stof_tvm.artifact.Artifact.save` writes an artifact this way: a save that fails midway (a full disk, a
failed link of ``module.so``, an interrupt) leaves an existing artifact in the directory as it was and no
temporary file behind. The renames at the end are the only step that touches it; they go in the order the files
were staged (the artifact stages its manifest last).
"""
from __future__ import annotations

import os
import secrets


class StagedFiles:
    """Files of directory ``root`` staged under temporary names in ``root`` (same file system: the renames are
    atomic), committed together by :meth:`commit`; leaving the ``with`` block without committing removes them."""

    def __init__(self, root: str):
        self.root = root
        self._staged: list[tuple[str, str]] = []         # (temporary path, final path) in staging order

    def path(self, name: str) -> str:
        """A temporary path to write file ``name`` (relative to the root) to. It keeps the name's extension:
        numpy and ``export_library`` choose the format from it. Not created here: the writer creates it, with the
        permissions it would give the file itself."""
        temp = os.path.join(self.root, f".stof-tmp-{os.getpid()}-{secrets.token_hex(6)}-{os.path.basename(name)}")
        self._staged.append((temp, os.path.join(self.root, name)))
        return temp

    def commit(self, stale: set[str] = frozenset()) -> None:
        """Rename every staged file into place, then remove the files named in ``stale`` (relative to the root:
        the previous contents' files) that this commit did not write."""
        written = set()
        for temp, final in self._staged:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.replace(temp, final)
            written.add(os.path.normpath(final))
        self._staged = []
        for name in stale:
            old = os.path.normpath(os.path.join(self.root, name))
            if old not in written and os.path.isfile(old):
                os.remove(old)

    def __enter__(self) -> "StagedFiles":
        return self

    def __exit__(self, *exc) -> None:
        for temp, _ in self._staged:
            if os.path.exists(temp):
                os.remove(temp)
        self._staged = []
