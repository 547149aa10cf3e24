"""``ddp_plain`` with a verdict hook: the process that runs the diagnoser appends each
verdict record it is handed (``ccld_plugin.on_verdict``) to the file HOOK_FILE."""

import json
import os

from ddp_plain import main

import ccld_plugin


@ccld_plugin.on_verdict
def to_file(record: dict) -> None:
    with open(os.environ["HOOK_FILE"], "a") as fh:
        fh.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
