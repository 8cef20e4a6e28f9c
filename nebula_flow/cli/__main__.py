from nebula_flow.cli import main

main()
