#!/usr/bin/env python3
"""The public items of a library crate, read from its rustdoc HTML (stable `cargo doc`, which CI
builds anyway), one per line: every item of the crate's "all items" page (modules' structs, enums,
traits, functions, constants, statics, type aliases, macros), and on each type's and trait's page
its public fields, variants, inherent methods and associated items, and the traits it implements
(not the automatic and blanket implementations). A 0.1 release freezes this list: CI compares it
with the committed one, so an accidental public item (or a lost one) fails until the list is
updated on purpose.

usage: public_api.py CRATE [--doc DIR] [--check FILE | --write FILE]
  CRATE     the crate's name as rustdoc writes it (memattn, memattn_candle)
  --doc     the rustdoc output folder (default target/doc)
  --check   exit 1 when FILE differs from the crate's list (the difference printed)
  --write   write the list to FILE
exit: 0 same (or written), 1 differs, 2 usage or no documentation (run `cargo doc --workspace --no-deps`).
"""
import difflib
import html
import os
import re
import sys

KINDS = {"struct", "enum", "trait", "fn", "constant", "static", "type", "macro", "union", "derive", "attr", "traitalias"}


def section(page, list_id):
    """The HTML of the `<div id="LIST_ID">` section of a page, up to the next such list or the end."""
    m = re.search(rf'id="{list_id}"', page)
    if not m:
        return ""
    rest = page[m.end():]
    nxt = re.search(r'id="(synthetic-implementations-list|blanket-implementations-list|trait-implementations-list|'
                    r'implementations-list|implementors-list|synthetic-implementors-list|foreign-impls)"', rest)
    return rest[:nxt.start()] if nxt else rest


def items(crate, doc):
    root = os.path.join(doc, crate)
    allp = os.path.join(root, "all.html")
    if not os.path.exists(allp):
        raise FileNotFoundError(allp)
    page = open(allp, encoding="utf-8").read()
    out = set()
    for href, text in re.findall(r'<a href="([^"#]+\.html)">([^<]+)</a>', page):
        base = os.path.basename(href)
        parts = base.split(".")
        if len(parts) != 3 or parts[0] not in KINDS:
            continue
        kind, path = parts[0], f"{crate}::{html.unescape(text)}"
        out.add(f"{kind} {path}")
        for mod in range(1, path.count("::")):
            out.add("mod " + "::".join(path.split("::")[:mod + 1]))
        if kind not in ("struct", "enum", "trait", "union"):
            continue
        sub = open(os.path.join(root, href), encoding="utf-8").read()
        for f in re.findall(r'id="structfield\.([A-Za-z0-9_]+)"', sub):
            out.add(f"field {path}::{f}")
        for v in re.findall(r'id="variant\.([A-Za-z0-9_]+)"', sub):
            out.add(f"variant {path}::{v}")
        inherent = section(sub, "implementations-list")
        for m in re.findall(r'id="(method|associatedconstant|associatedtype)\.([A-Za-z0-9_]+)"', inherent):
            out.add(f"{m[0].replace('associated', 'assoc ')} {path}::{m[1]}")
        if kind == "trait":
            for m in re.findall(r'id="(tymethod|method|associatedconstant|associatedtype)\.([A-Za-z0-9_]+)"', sub):
                out.add(f"trait-item {path}::{m[1]}")
        traits = section(sub, "trait-implementations-list")
        for t in re.findall(r'<section id="impl-([^"]+)" class="impl"', traits):
            out.add(f"impl {path}: {html.unescape(t)}")
    return sorted(out)


def main(argv):
    args = argv[1:]
    if not args or args[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    crate, doc, check, write = args[0], "target/doc", None, None
    i = 1
    while i < len(args):
        if args[i] in ("--doc", "--check", "--write") and i + 1 < len(args):
            if args[i] == "--doc":
                doc = args[i + 1]
            elif args[i] == "--check":
                check = args[i + 1]
            else:
                write = args[i + 1]
            i += 2
        else:
            print(__doc__, file=sys.stderr)
            return 2
    try:
        lines = items(crate, doc)
    except FileNotFoundError as e:
        print(f"public_api.py: no rustdoc output at {e} (run `cargo doc --workspace --no-deps` first: the lists are of the workspace build, its features unified)", file=sys.stderr)
        return 2
    text = "".join(line + "\n" for line in lines)
    if write:
        tmp = write + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, write)
        print(f"public_api.py: {len(lines)} public items of {crate} written to {write}")
        return 0
    if check:
        old = open(check, encoding="utf-8").read() if os.path.exists(check) else ""
        if old == text:
            print(f"public_api.py: {crate}'s {len(lines)} public items are the committed list ({check})")
            return 0
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True), check, f"{crate} now"))
        print(f"public_api.py: {crate}'s public items differ from {check} (above); if the change is meant, "
              f"run `cargo doc --workspace --no-deps && python3 scripts/public_api.py {crate} --write {check}`")
        return 1
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
