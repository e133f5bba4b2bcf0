from .cli.main import main

# Guarded: `serve-model --engine-process` spawns a process that imports this module again.
if __name__ == "__main__":
    main()
