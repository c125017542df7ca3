"""`python -m tilepd.runtime --config FILE`: run one decode node (see tilepd.cli.runtime_cmds for all flags)."""

from tilepd.cli.runtime_cmds import main

if __name__ == "__main__":
    main()
