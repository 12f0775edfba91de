from gpugate.cli import run

run()
