"""Source kinds `folder` (one sub-folder of images per class, labels the sorted sub-folder names) and `unlabelled`
(every image under SOURCE, recursively, label -1): trees walked depth first, sorted, straight into the catalog,
whatever is met and not used recorded with its reason. See docs/build_shards.md#sources.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

from data_tools.builder.catalog import CatalogWriter
from data_tools.builder.sources.base import (
    FailureLog,
    FileReader,
    Listing,
    Progress,
    SourceError,
    SourceSpec,
    check_split_names,
    os_error_detail,
)
from vit_mpp.data.image_formats import IMAGE_SUFFIXES, is_image_file

SPLIT_LIKE = {"train", "val", "valid", "validation", "test"}  # class folders with these names are probably splits


def _sorted_entries(folder: str, rel: str, failures: FailureLog) -> list[os.DirEntry]:
    """A folder's entries sorted by name, hidden ones left out; [] (and a recorded failure) if it cannot be read."""
    try:
        with os.scandir(folder) as it:
            return sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
    except OSError as e:
        failures.add(rel or ".", "unreadable_folder", os_error_detail(e))
        return []


def _entry_kind(entry: os.DirEntry) -> tuple[str, str]:
    """("dir" | "file", "") for what a (possibly linked) entry is, else a failure (reason, detail)."""
    try:
        if entry.is_dir():
            return "dir", ""
        if entry.is_file():
            return "file", ""
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "symlink_loop", "the chain of links loops"
        return "unreadable", os_error_detail(e)
    if entry.is_symlink():
        try:
            os.stat(entry.path)
        except FileNotFoundError:
            return "broken_link", f"the link points to a missing target: {os.readlink(entry.path)}"
        except OSError as e:
            if e.errno == errno.ELOOP:
                return "symlink_loop", "the chain of links loops"
            return "unreadable", os_error_detail(e)
    return "not_a_file", "a special file (pipe, socket or device)"


def _folder_key(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def walk_images(root: str, start: str, failures: FailureLog, emit: Callable[[str], None]) -> None:
    """`emit` the path (relative to `root`) of every image file under root/start, depth first with each folder's
    entries sorted by name, following links. Only the entries of the folders on the current path are held."""
    top = os.path.join(root, start) if start else root
    try:
        top_key = _folder_key(top)
    except OSError as e:
        failures.add(start or ".", "unreadable_folder", os_error_detail(e))
        return
    ancestors = {top_key}
    stack = [(start, iter(_sorted_entries(top, start, failures)), top_key)]
    while stack:
        rel_dir, entries, key = stack[-1]
        entry = next(entries, None)
        if entry is None:
            stack.pop()
            ancestors.discard(key)
            continue
        rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
        kind, detail = _entry_kind(entry)
        if kind == "dir":
            try:
                sub_key = _folder_key(entry.path)
            except OSError as e:
                failures.add(rel, "unreadable_folder", os_error_detail(e))
                continue
            if sub_key in ancestors:
                failures.add(rel, "symlink_loop", "a link to a folder that contains it")
                continue
            ancestors.add(sub_key)
            stack.append((rel, iter(_sorted_entries(entry.path, rel, failures)), sub_key))
        elif kind == "file":
            if is_image_file(entry.name):
                emit(rel)
            else:
                suffix = os.path.splitext(entry.name)[1].lower()
                failures.add(rel, "not_an_image", f"extension '{suffix}' is not an image's "
                             f"({' '.join(sorted(IMAGE_SUFFIXES))})")
        else:
            failures.add(rel, kind, detail)


def _subfolders(folder: str, rel: str, failures: FailureLog, files_reason: str) -> list[str]:
    """Names of the sub-folders of `folder`; its other entries are recorded as failures (`files_reason`)."""
    names = []
    for entry in _sorted_entries(folder, rel, failures):
        kind, detail = _entry_kind(entry)
        entry_rel = f"{rel}/{entry.name}" if rel else entry.name
        if kind == "dir":
            names.append(entry.name)
        elif kind == "file":
            failures.add(entry_rel, files_reason, "a file where sub-folders are expected")
        else:
            failures.add(entry_rel, kind, detail)
    return names


def list_folder(spec: SourceSpec, writer: CatalogWriter, failures: FailureLog, labelled: bool) -> list[str]:
    """List a class-folder tree (`labelled`) or any tree of images (label -1) into `writer`; with existing splits,
    each sub-folder of SOURCE is a split holding such a tree, and classes are the union over splits (so labels
    agree). Returns the class names."""
    root = spec.path
    if not os.path.isdir(root):
        raise SourceError(f"source folder not found: {root}")
    try:
        os.scandir(root).close()
    except OSError as e:
        raise SourceError(f"cannot read source folder {root}: {os_error_detail(e)}") from None
    if spec.existing_splits:
        split_rels = _subfolders(root, "", failures, "outside_split_folder")
        if not split_rels:
            raise SourceError(f"--existing-splits: {root} has no split sub-folders (expected {root}/train, ...)")
        check_split_names(split_rels, root)
    else:
        split_rels = [""]
    if not labelled:
        for rel in split_rels:
            code = writer.split_code(rel)
            walk_images(root, rel, failures, lambda path, c=code: writer.add(path, -1, c))
        return []
    per_split = {rel: _subfolders(os.path.join(root, rel) if rel else root, rel, failures, "outside_class_folder")
                 for rel in split_rels}
    classes = sorted({c for names in per_split.values() for c in names})
    if not classes:
        where = f"{root}/<split>" if spec.existing_splits else root
        raise SourceError(f"{where} has no class sub-folders (expected {where}/<class>/<image>; "
                          "use --source-kind unlabelled for a plain tree of images)")
    for rel, names in per_split.items():
        code = writer.split_code(rel)
        present = set(names)
        for label, name in enumerate(classes):
            if name in present:
                start = f"{rel}/{name}" if rel else name
                walk_images(root, start, failures, lambda path, lb=label, c=code: writer.add(path, lb, c))
    return classes


def list_class_folders(spec: SourceSpec, writer: CatalogWriter, failures: FailureLog, seed: int,
                       progress: Progress) -> Listing:
    """Kind `folder`: a class-folder tree; items are read by their path under SOURCE."""
    class_names = list_folder(spec, writer, failures, labelled=True)
    if not spec.existing_splits and set(class_names) <= SPLIT_LIKE:
        print(f"note: the class folders of {spec.path} look like splits ({', '.join(class_names)}); "
              "pass --existing-splits to use them as splits")
    return Listing(FileReader(spec.path), class_names)


def list_image_tree(spec: SourceSpec, writer: CatalogWriter, failures: FailureLog, seed: int,
                    progress: Progress) -> Listing:
    """Kind `unlabelled`: every image under SOURCE, label -1."""
    list_folder(spec, writer, failures, labelled=False)
    return Listing(FileReader(spec.path))
