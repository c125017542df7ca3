from tilepd.cli.app import main

main()
