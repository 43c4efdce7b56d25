//! Chat templates: the model's Jinja template (`tokenizer.chat_template`)
//! rendered with minijinja the way HF transformers renders it (trimmed
//! blocks, Python string methods, `raise_exception`).

use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, ErrorKind, context};

use crate::{Error, Result};

/// ChatML, used when a model ships no template of its own.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

const TEMPLATE_NAME: &str = "chat";

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` (or `tool`).
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and text.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    environment: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` are the texts templates may
    /// reference.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut environment = Environment::new();
        let syntax = SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build().map_err(|error| Error::Template(error.to_string()))?;
        environment.set_syntax(syntax);
        environment.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        environment.add_function("raise_exception", |message: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
        });
        environment
            .add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(|error| Error::Template(format!("chat template does not compile: {error}")))?;
        Ok(Self { environment, bos_token: bos_token.to_owned(), eos_token: eos_token.to_owned() })
    }

    /// Renders a conversation into prompt text. With `add_generation_prompt`
    /// the text ends where the assistant's next message begins. Errors raised
    /// by the template (e.g. roles that must alternate) are returned as
    /// [`Error::Template`] with the template's message.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let template = self.environment.get_template(TEMPLATE_NAME).map_err(|error| Error::Template(error.to_string()))?;
        template
            .render(context! {
                messages => messages
                    .iter()
                    .map(|message| {
                        minijinja::Value::from_pairs([
                            ("role", message.role.as_str()),
                            ("content", message.content.as_str()),
                        ])
                    })
                    .collect::<Vec<_>>(),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.as_str(),
                eos_token => self.eos_token.as_str(),
            })
            .map_err(|error| {
                let message = match error.kind() {
                    ErrorKind::InvalidOperation => error.detail().unwrap_or("invalid conversation").to_owned(),
                    _ => error.to_string(),
                };
                Error::Template(message)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_renders_a_generation_prompt() {
        let template = ChatTemplate::new(CHATML_TEMPLATE, "", "<|im_end|>").unwrap();
        let text = template.render(&[ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi")], true).unwrap();
        assert_eq!(text, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn raise_exception_becomes_a_template_error_with_its_message() {
        let source = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok";
        let template = ChatTemplate::new(source, "", "").unwrap();
        let error = template.render(&[ChatMessage::new("assistant", "x")], true).unwrap_err();
        assert_eq!(error.to_string(), "chat template: first message must be from the user");
        assert_eq!(template.render(&[ChatMessage::new("user", "x")], true).unwrap(), "ok");
    }

    #[test]
    fn python_string_methods_work() {
        let template = ChatTemplate::new("{{ messages[0]['content'].strip() }}", "", "").unwrap();
        assert_eq!(template.render(&[ChatMessage::new("user", "  hi  ")], false).unwrap(), "hi");
    }

    #[test]
    fn a_broken_template_is_refused_at_load() {
        assert!(matches!(ChatTemplate::new("{% for %}", "", ""), Err(Error::Template(_))));
    }
}
