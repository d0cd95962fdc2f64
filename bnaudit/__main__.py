from bnaudit.cli import main

main()
