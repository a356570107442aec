"""The side-by-side CPU benchmark's parts (`python -m bench peers`, orchestrated by
`bench.peers.run`): timing rows and the table (`table`), our engine per precision (`ours`), and the two
independent CPU engines it is compared with, each set up on our random checkpoint (`c_engine`, `vox`)."""
