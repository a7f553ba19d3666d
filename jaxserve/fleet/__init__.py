"""Several models and versions in one server (`jaxserve serve --models models.toml`).

- `models_file`: the TOML file (names, versions, paths, weights, presets, devices,
  fallbacks), checked before anything loads;
- `served_model`: one version's engine from load to drain and release;
- `routing`: which version answers a request (weights, pinned ids, fallbacks);
- `device_turns`: round-robin steps of engines that share a device;
- `fleet`: all of them, loaded at start and reloaded on `SIGHUP` / `POST /admin/reload`.

One model (`--model`) is a fleet of one entry, so the server has one path for both.
"""
