//! A vector of slots with a free list: stable u32 handles for the event loop's objects.

pub(crate) struct Slab<T> {
    items: Vec<Option<T>>,
    free: Vec<u32>,
    len: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab { items: Vec::new(), free: Vec::new(), len: 0 }
    }
}

impl<T> Slab<T> {
    pub fn insert(&mut self, value: T) -> u32 {
        self.len += 1;
        match self.free.pop() {
            Some(i) => {
                debug_assert!(self.items[i as usize].is_none());
                self.items[i as usize] = Some(value);
                i
            }
            None => {
                self.items.push(Some(value));
                (self.items.len() - 1) as u32
            }
        }
    }

    pub fn remove(&mut self, i: u32) -> T {
        let v = self.items[i as usize].take().expect("slab slot is live");
        self.free.push(i);
        self.len -= 1;
        v
    }

    pub fn get(&self, i: u32) -> Option<&T> {
        self.items.get(i as usize).and_then(|x| x.as_ref())
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.items.iter().enumerate().filter_map(|(i, x)| x.as_ref().map(|v| (i as u32, v)))
    }
}

impl<T> std::ops::Index<u32> for Slab<T> {
    type Output = T;
    fn index(&self, i: u32) -> &T {
        self.items[i as usize].as_ref().expect("slab slot is live")
    }
}

impl<T> std::ops::IndexMut<u32> for Slab<T> {
    fn index_mut(&mut self, i: u32) -> &mut T {
        self.items[i as usize].as_mut().expect("slab slot is live")
    }
}
