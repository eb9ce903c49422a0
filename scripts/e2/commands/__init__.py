"""One module per ``e2`` verb: its argparse parser (``add_parser``) and ``run``,
which takes the global options and the verb's options (e2.options) and
returns the exit code. The work itself is in the modules named for what they
own (apply, overlay, validate, image, probes/, ...)."""
