"""A run's folder and its stream, standard library only (the ranks import it before torch): the folder's
layout (runfolder.py), the stream's messages (protocol.py), reading them (stream.py), folding them into
what a front end knows (runstate.py), and TensorBoard's files (tbevents.py).
"""
