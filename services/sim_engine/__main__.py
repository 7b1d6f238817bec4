from .cli import sim_engine_command

if __name__ == "__main__":
    sim_engine_command(prog_name="python -m services.sim_engine")
