"""Volunteer settings in the vocabulary of BOINC and Folding@home (issue 14).

:mod:`.model` defines the settings (one pydantic model: defaults, help, validation) and
where they are stored; :mod:`.schedule` decides, without I/O, whether a round may start
now; :mod:`.probes` reads the machine (idle time, battery); :mod:`.throttle` caps the
upload rate; :mod:`.gate` pauses a running node between rounds; :mod:`.options` turns
the model into ``ftis-client start`` flags.
"""
