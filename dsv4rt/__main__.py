from .cli import main

main(prog_name="dsv4rt")
