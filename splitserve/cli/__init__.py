"""The ``splitserve`` command and what only it needs: flags, config files, ``up``, sizing, tune."""


def main(argv=None):
    from splitserve.cli.commands import main as run
    return run(argv)
