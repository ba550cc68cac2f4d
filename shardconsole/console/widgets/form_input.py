"""FormInput: an Input whose editing keys take effect in the order they were typed.

Textual's Input inserts a printable key as soon as the key reaches it, but runs its editing keys
(backspace, delete, ctrl+u, home, end, left, ...) through the binding chain, which only happens once the
key has bubbled back up to the app. Keys that arrive in one burst (a fast typist, a loaded machine, a
terminal's single read, tmux send-keys) are all forwarded to the Input before the first of them bubbles
back, so "ctrl+u 7123" inserted 7123 and then cleared it, and "backspace 12" deleted the 2. Running the
Input's own bindings where the key arrives keeps the keystrokes in order.
"""

from __future__ import annotations

from textual import events
from textual.widgets import Input


class FormInput(Input):
    async def _on_key(self, event: events.Key) -> None:
        if not event.is_printable:
            # Only this widget's own bindings (the editing keys): a form's or a screen's key still goes
            # the ordinary way, after the widgets below it had their say.
            for binding in self._bindings.key_to_bindings.get(event.key, ()):
                if not binding.priority and await self.app.run_action(binding.action, self):
                    event.stop()
                    event.prevent_default()   # Input's own handler (MRO dispatch) has nothing left to do
                    return
