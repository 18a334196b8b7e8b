"""The commands (`trainbox NAME`), one thin module each, named by the command table (common/commands.py)."""
