"""``python -m adaloss_cli`` runs the ``adaloss`` command."""

from adaloss_cli.cli import main

if __name__ == "__main__":
    main()
