"""The runtime package: the contract between `flare prepare` (which writes it) and
`flare serve` (which reads it). Both halves import from here; the serving side
(`flare.runtime`, `flare.state`, `flare.server`) never imports `flare.prepare`.

- `contract`: the manifest schema, version constants, payload hashing and checks;
- `plan`: the capacity plan and memory report types, and the state layout they give;
- `reader`: load and verify a package (`load_package`).
"""
