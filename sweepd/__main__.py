from sweepd.cli import entry

entry()
