"""The options every capture subcommand of ``python3 -m moeconf`` shares
(``llamacpp``, ``vllm``, ``transformers``): the bound model name, the prompt
and the run's length and output."""


def add_run_arguments(a, name_help):
    """Adds ``--name`` (help ``name_help``), ``--prompt`` | ``--prompt-file``
    (one required), ``--max-new-tokens`` and ``-o/--output`` to the argparse
    parser ``a``."""
    a.add_argument("--name", default=None, help=name_help)
    g = a.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt")
    g.add_argument("--prompt-file")
    a.add_argument("--max-new-tokens", type=int, required=True)
    a.add_argument("-o", "--output", required=True)
