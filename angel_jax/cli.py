"""The command-line parser of the launcher and the generator: one-line errors, and `--config.KEY=
VALUE` overrides passed through while any other unknown flag is refused by name."""

import argparse
import difflib
import re
import sys

# Other tools' flags for ours, named where the nearest spelling would mislead: difflib takes
# --max-new-tokens for --prompt-tokens. A hint is given only by a parser that has its flag.
HINTS = {
    "--max-new-tokens": "--steps",
    "--max_new_tokens": "--steps",
    "--max-tokens": "--steps",
    "--work_dir": "--workdir",
    "--output_dir": "--workdir",
}


class Parser(argparse.ArgumentParser):
    def __init__(self, hints: dict[str, str] = HINTS, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)  # --work is not --workdir: say so.
        self.hints = hints

    def error(self, message):  # One line, like every other input error.
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        """(known flags, the `--config.` overrides); a misspelt flag is named before a
        required one is missed."""
        args = sys.argv[1:] if args is None else list(args)
        known = sorted(s for action in self._actions for s in action.option_strings)
        for arg in args:
            flag = arg.split("=", 1)[0]
            is_flag = re.match(r"--?[A-Za-z]", flag)  # Not a value such as -1.
            if is_flag and not flag.startswith("--config.") and flag not in known:
                close = [h for h in [self.hints.get(flag)] if h in known]
                close = close or difflib.get_close_matches(flag, known, n=1)
                self.error(
                    f"unknown flag {flag}" + (f"; did you mean {close[0]}?" if close else "")
                )
        return super().parse_known_args(args, namespace)
