"""`edit-train-keygen PATH`: make a federation key (32 random bytes, hex, mode 0600) at PATH.

Give the same file to every cluster (`federation.key_file=PATH` or `EDIT_TRAIN_FEDERATION_KEY_FILE`) and to
`edit-train-lighthouse`; copy it over a channel you trust (scp, your secrets manager). It never overwrites a
file: rotating the key is a new file, then a restart of the federation with it (docs/architecture.md,
"Security model").
"""

from __future__ import annotations

import argparse
import sys

from edit_train.cli.common import fail


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="edit-train-keygen", description="Make a federation key (mode 0600).")
    p.add_argument("path", help="where to write the key (refused if the file exists)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    from edit_train.federation import auth

    try:
        path = auth.new_key(args.path)
        key = auth.load_key(path)
    except (auth.KeyFileError, OSError) as exc:
        fail(str(exc) if isinstance(exc, auth.KeyFileError) else f"cannot write {args.path}: {exc.strerror}")
    print(f"edit-train-keygen: wrote a federation key to {path} (mode 0600, id {auth.fingerprint(key)}); "
          f"give every cluster and the Lighthouse federation.key_file={path}")


if __name__ == "__main__":
    main()
