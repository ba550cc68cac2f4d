"""What a front end works out when the ranks cannot say what went wrong: a hang (no step; where each rank
is, from its stack), every rank lost at once (no end line anywhere), the stream itself gone (the other
evidence the run folder keeps). outcome, the watcher, cluster and run ask them; they ask nothing of the
rest of the session: the standard library, the settings, the run log and the launcher's process checks.
"""
